/*
 * Mutant D -- lease expiry on prefill frees without a fence.
 *
 * When the lease deadline passes while decode's pull is still reading,
 * prefill frees the pages at once instead of quarantining them until decode
 * confirms it stopped or the fence time passes. The change is the
 * #ifdef MUTANT_D block in ../handoff.pml (Prefill, "the lease deadline
 * passes").
 *
 * Expected: spin finds I2_reader_owns_page (the pull reads, on behalf of the
 * request, a page that is no longer its own) or I6_no_reuse_under_transfer
 * (the page is handed to the other request while the pull can still read it).
 */
#define MUTANT_D
#include "../handoff.pml"
