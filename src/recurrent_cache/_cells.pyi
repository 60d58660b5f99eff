# The cell-table primitives are C-level only (``cimport recurrent_cache._cells``).
