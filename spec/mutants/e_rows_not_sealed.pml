/*
 * Mutant E -- rows are staged in the clear: prefill holds a request's KV in registered
 * memory without sealing it (the #ifndef MUTANT_E block in ../handoff.pml, Prefill).
 *
 * Expected: spin finds I10_network_reads_see_no_plaintext: the adversary reads a
 * tenant's KV from a held row.
 */
#define MUTANT_E
#define ADVERSARY
#define CORRUPTIONS 0
#include "../handoff.pml"
