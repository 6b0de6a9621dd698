/*
 * Mutant F -- the rows' key is not bound to the request: decode accepts a pulled row
 * sealed for another request as long as epoch and prefill generation match (the #ifndef
 * MUTANT_F line in ../handoff.pml, Decode's verification).
 *
 * Expected: the adversary copies another tenant's sealed row over this request's row;
 * it verifies, and decode would attend another tenant's KV:
 * I5_decode_after_verified_transfer (or I2_reader_reads_own_data).
 */
#define MUTANT_F
#define ADVERSARY
#define CORRUPTIONS 0
#include "../handoff.pml"
