/*
 * Mutant H -- the control plane is not authenticated: prefill takes a forged "decode
 * stopped reading" message and frees rows a pull may still read (the MUTANT_H line in
 * ../handoff.pml, Adversary).
 *
 * Expected: the pull reads a freed or reused row: I2_reader_owns_page (or
 * I6_no_reuse_under_transfer).
 */
#define MUTANT_H
#define ADVERSARY
#define CORRUPTIONS 0
#include "../handoff.pml"
