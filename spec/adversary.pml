/*
 * The handoff model with a network adversary (I10, I11): see the ADVERSARY notes in
 * handoff.pml and spec/README.md. Checked by tests/spec with -DSAFETY. The adversary's
 * own writes are every corruption a transfer could suffer, so the in-flight corruption
 * budget is off here.
 */
#define ADVERSARY
#define CORRUPTIONS 0
#include "handoff.pml"
