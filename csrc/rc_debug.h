/* RC_SELF_CHECK: set by the build when bounds checks are on (RECURRENT_CACHE_BOUNDSCHECK=ON);
 * the core then checks every invariant of the cell table after each placement, as
 * llama.cpp's debug build checks the tails in find_slot. */
#ifndef RC_SELF_CHECK
#define RC_SELF_CHECK 0
#endif
