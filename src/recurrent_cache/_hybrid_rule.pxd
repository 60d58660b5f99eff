# cython: language_level=3
"""C-level API of a hybrid memory's rule (docs/hybrid.md, "The hybrid memory"): the sequence operations
of the compiled engine's ``HybridCache`` over both halves, once, for its Python facade and the C API.

Each works on the recurrent half's memory core and the KV half's cell table, ``noexcept nogil``: its
arguments already int32 (the facade converts and bounds them: a range bound below 0 is -1, "open"),
it changes both halves or neither, and a refusal is a negative code with what ``rule_error`` needs
to word it in ``*d``.
"""

from libc.stdint cimport int32_t, int64_t

from ._core_ops cimport Core
from ._kv_table cimport KvTable

cdef enum:                       # how a refusal's message names its call (RuleDetail.what_kind)
    WHAT_CALL = 0                # the call alone
    WHAT_SEQ = 1                 # "{what}: seq_id {seq}"
    WHAT_SHIFT = 2               # "{what}: seq_id {seq} at pos {pos} shifted by {n}"

cdef struct RuleDetail:          # what a refusal was about
    int code                     # errors.py's code (CAPI_KV: the KV table's code n, its values index, need)
    const char* what             # the operation (a static string)
    int what_kind
    int64_t seq, pos, prev, n, index, need, size

# the number of sequences both halves take (the KV table's n_seq_max, the recurrent cells)
cdef int rule_seq(const KvTable* kv, int32_t seq, const char* what, RuleDetail* d) noexcept nogil
# 1 when removed (or rolled back), 0 when the recurrent half refused (nothing changed)
cdef int rule_seq_rm(Core* core, KvTable* kv, int32_t seq, int32_t p0, int32_t p1) noexcept nogil
cdef int rule_seq_cp(Core* core, KvTable* kv, int32_t src, int32_t dst, int32_t p0, int32_t p1,
                     RuleDetail* d) noexcept nogil
cdef int rule_seq_keep(Core* core, KvTable* kv, int32_t seq, RuleDetail* d) noexcept nogil
cdef int rule_seq_add(Core* core, KvTable* kv, int32_t seq, int32_t p0, int32_t p1, int32_t shift,
                      RuleDetail* d) noexcept nogil
cdef int rule_seq_div(Core* core, KvTable* kv, int32_t seq, int32_t p0, int32_t p1, int32_t d_,
                      RuleDetail* d) noexcept nogil
# seq's first (last) position in both halves; a refusal (seq out of range) is its code, -1
cdef int32_t rule_seq_pos(const Core* core, const KvTable* kv, bint attention, int32_t seq, bint last,
                          RuleDetail* d) noexcept nogil
cdef int32_t rule_rollback_min(Core* core, const KvTable* kv, int32_t seq, RuleDetail* d) noexcept nogil
# the exception the Python API raises for a refusal
cdef object rule_error(const RuleDetail* d)
