/*
 * Mutant C -- the late-write race: decode frees on abort while its pull is
 * in flight.
 *
 * Decode gives up on a request (timeout, abort) after starting the pull and
 * frees the destination pages at once instead of quarantining them until the
 * transfer engine reports the pull over. The change is the #ifdef MUTANT_C
 * block in ../handoff.pml (Decode, "give up").
 *
 * Expected: spin finds an I6 violation: the pull writes into a page that is
 * free or already belongs to the other tenant's request
 * (I6_transfer_writes_own_page or I6_no_reuse_under_transfer).
 */
#define MUTANT_C
#include "../handoff.pml"
