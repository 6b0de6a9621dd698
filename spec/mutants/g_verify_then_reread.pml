/*
 * Mutant G -- verify, then read again: decode checks the pulled rows and then reads the
 * registered rows a second time to use them, so a write that lands in between reaches
 * attention unchecked (the MUTANT_G DP_WRITABLE in ../handoff.pml, Adversary).
 *
 * Expected: I10_attention_reads_no_foreign_bytes.
 */
#define MUTANT_G
#define ADVERSARY
#define CORRUPTIONS 0
#include "../handoff.pml"
