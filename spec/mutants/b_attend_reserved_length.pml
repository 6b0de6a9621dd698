/*
 * Mutant B -- decode attends the reserved length, not the written one.
 *
 * Decode reserves prompt + max_tokens pages but only the prompt pages are
 * written by the verified transfer; this mutant attends every reserved slot.
 * The change is the #ifdef MUTANT_B block in ../handoff.pml (Decode, "one
 * decode step").
 *
 * Expected: spin finds I3_reads_written_slots_only: decode reads a reserved,
 * unwritten slot, which holds whatever an earlier request left there.
 */
#define MUTANT_B
#include "../handoff.pml"
