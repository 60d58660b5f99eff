"""The bytes of a recurrent state, described once (docs/concepts.md §5, llama.cpp's recurrent
``state_write``), one module per concept, each importing only those above it in this list:

- ``dtypes``: the ggml type table (``STATE_TYPES`` / ``GGML_TYPES``); imports nothing of the package;
- ``layouts``: every fixed run of fields (``Layout``), the file formats (``SeqFileFormat``), the
  framings' names, the magics and limits;
- ``messages``: the wording of every blob defect, and the blob error codes' exceptions;
- ``geometry``: ``Geometry``, the one shape of a cache's state;
- ``blob``: a memory section parsed (``parse_blob``) and the header builders;
- ``kv``: a hybrid's attention KV section as data (``parse_kv_section``, ``compose_kv_section``),
  the one reader the framings step over it with;
- ``streams``: binary files and buffers (``FileReader``, ``write_all``, ``target_view``);
- ``framings``: the framings around a memory section found from the bytes (``read_framing``);
- ``files``: a state read whole from a file (``read_file``, ``read_rest``).

This package module imports none of them, so importing one loads only what it needs
(``storage`` takes the type table without the parsers).
"""
