/*
 * Mutant A -- the incident: handoff after a rejection.
 *
 * Prefill rejects the request (NEW -REJECT-> REJECTED) but, as in the
 * postmortem, replaces the prompt with a one-page placeholder and returns a
 * handle anyway; the router hands it to decode, which reserves pages for the
 * full length. The change is the #ifdef MUTANT_A block in ../handoff.pml
 * (Router, "to prefill ... may reject anything").
 *
 * Expected: spin finds I4_no_resources_after_reject (prefill allocates a
 * page for a request it rejected), the first point the bug breaks a property.
 */
#define MUTANT_A
#include "../handoff.pml"
