/*
 * kvfence -- Promela model of the prefill/decode (PD) KV handoff.
 *
 * Parties: the router, the prefill node, the decode node, the transfer engine
 * (one-sided reads of prefill's pages, started by decode), the two page
 * pools, and an environment that crashes processes. Two requests from two
 * tenants run concurrently over small pools, so pages are reused between
 * them. spec/README.md has the protocol in prose, what is abstracted away,
 * the bounds, and the measured numbers.
 *
 * Naming contract (checked by tests/spec/test_state_names.py):
 *   - request states and events are exactly the names of State and Event in
 *     kvfence/engine/request_states.py (mtype:state and mtype:event below);
 *   - every request state change is a call advance(var, FROM, EVENT, TO)
 *     with literal names, so the test can extract the triples;
 *   - ps[r] is request r's record on the prefill node, ds[r] its record on
 *     the decode node. NEW there also covers "this node has not seen it".
 *
 * Mutants: each spec/mutants/<x>.pml defines one MUTANT_<X> macro and
 * includes this file; the #ifdef MUTANT_<X> block below is that mutant's
 * whole change.
 */

/* ------------------------------------------------------------------ bounds */

#define NREQ    2   /* concurrent requests; request r belongs to tenant r      */
#define NP      2   /* pages in the prefill pool                                */
#define ND      4   /* pages in the decode pool                                 */
#define GEN     1   /* pages for generated tokens (max_tokens), decode only     */
#define CTX     3   /* smallest usable context on the path, in pages (I8)       */
#define MAXP    2   /* CTX - GEN: the longest admissible prompt, in pages       */
#define LONG    3   /* an over-length prompt: LONG + GEN > CTX                  */

#ifndef CRASHES
#define CRASHES 1   /* process crashes per run, prefill and decode together     */
#endif
#ifndef CORRUPTIONS
#define CORRUPTIONS 1 /* pages corrupted in flight per run                     */
#endif
#ifndef DUPLICATES
#define DUPLICATES 1  /* duplicated completion notices per run                 */
#endif

/* owner and data tags: a request id 0..NREQ-1, or one of these */
#define NOBODY  2   /* owner of a free page                                     */
#define GARBAGE 3   /* data: corrupted in flight                                */
#define OLD     4   /* data: KV of a request from before the model starts.
                       Pools are never zeroed (scrub policy "none", I7).       */
#define ADV     5   /* data: bytes a network adversary wrote (ADVERSARY only)   */

/* The network adversary (I10, I11), compiled in with -DADVERSARY (spec/adversary.pml):
 * a party on the PD network without the cluster secret. It may read any registered
 * page, overwrite one with bytes of its own, copy a sealed page over another (replay,
 * splice), and forge control messages. Rows are sealed: a page carries the binding it
 * was sealed under (request, row epoch, prefill generation), which only prefill can
 * produce, and decode accepts a pulled page only if it opens under the binding the
 * manifest names. ADVS bounds its actions per run. */
#ifndef ADVS
#define ADVS 1
#endif

/* --------------------------------------------------------------- the names */

/* the code's state table, same names (kvfence/engine/request_states.py) */
mtype:state = { NEW, REJECTED, WAITING, PREFILLING, KV_HELD, AWAITING_KV,
                DECODING, FINISHED, ABORTED };
mtype:event = { ADMIT, REJECT, SCHEDULE, PREFILL_DONE, PREEMPT, HOLD_KV,
                RELEASE, RESERVE, VERIFY, FINISH, ABORT };

mtype:pg     = { FREE, OWNED, QUARANTINED };              /* page state       */
mtype:route  = { RT_NEW, RT_PREFILL, RT_DECODE, RT_DONE }; /* router's record */
mtype:answer = { C_WAIT, C_400, C_ERR, C_OK, C_GONE };    /* client's answer  */
mtype:xfer   = { X_IDLE, X_RUN, X_OK, X_FAIL };           /* r's pull         */

/* ------------------------------------------------------------ properties
 * CHECK(name, cond) asserts cond. The name is a hidden variable that is
 * always 0: it adds nothing to the state, and spin prints it in the text of
 * a failed assertion, so a counterexample says which property broke. */
hidden byte I1_alloc_free_page_only;
hidden byte I1_free_own_page_only;
hidden byte I2_reader_owns_page;
hidden byte I2_reader_reads_own_data;
hidden byte I2_writer_owns_page;
hidden byte I3_reads_written_slots_only;
hidden byte I4_no_resources_after_reject;
hidden byte I4_no_handoff_after_reject;
hidden byte I5_decode_after_verified_transfer;
hidden byte I6_transfer_writes_own_page;
hidden byte I6_no_reuse_under_transfer;
hidden byte END_all_answered;
hidden byte END_all_terminal;
hidden byte END_no_transfer_running;
hidden byte END_no_page_leaked;
hidden byte END_200_only_after_decode;
hidden byte END_400_iff_over_length;
hidden byte I10_network_reads_see_no_plaintext;
hidden byte I10_attention_reads_no_foreign_bytes;
#define CHECK(name, cond) assert((cond) || name)

/* ------------------------------------------------------------ global state */

typedef Page {
    byte  owner;   /* request id, or NOBODY                       (ledger, I1) */
    byte  epoch;   /* bumped every time the page is freed                      */
    mtype:pg st;
    byte  data;    /* whose KV the page holds: a request id, GARBAGE or OLD    */
#ifdef ADVERSARY
    byte  sr;      /* sealed for this request (NOBODY: bytes in the clear)     */
    byte  se;      /* ... this row epoch                                       */
    byte  sg;      /* ... by this prefill generation                           */
#endif
};
Page pp[NP];       /* prefill pool */
Page dp[ND];       /* decode pool  */
byte pfree = NP;   /* FREE pages per pool; a function of the pages, so it adds */
byte dfree = ND;   /* no states (END_no_page_leaked checks it)                 */

byte plen[NREQ];   /* prompt length in pages, chosen by init; LONG: too long   */

/* router's record and what the client got */
mtype:route rt[NREQ];
mtype:answer cl[NREQ];

/* asynchronous messages, one bit per kind and request */
#define P_ABORT  1  /* -> prefill: abort (router, or relayed decode failure)  */
#define P_ACK    2  /* decode -> prefill: transfer verified, release           */
#define P_DSTOP  4  /* decode -> prefill: decode gave up and reads no more     */
#define D_ABORT  1  /* -> decode: abort (router, or relayed prefill failure)   */
#define R_HANDLE 1  /* prefill -> router: handle + manifest                    */
byte to_p[NREQ];
byte to_d[NREQ];
byte to_r[NREQ];

/* prefill node */
mtype:state ps[NREQ];
byte pgen;                  /* prefill process generation (bumped by a crash)  */
byte pn[NREQ];              /* pages held                                       */
byte pbt[NREQ * MAXP];      /* block table: page index of each prompt page      */
byte pep[NREQ * MAXP];      /* epoch of each page when allocated                */
bool pquar[NREQ];           /* r's pages are quarantined                        */
bool expired[NREQ];         /* r's lease deadline has passed                    */

/* the handle and manifest prefill hands out (its page list is pbt/pep) */
byte mcount[NREQ];          /* prompt pages (the token count)                   */
byte msum[NREQ * MAXP];     /* per-page checksum = the data tag written         */
byte mgen[NREQ];            /* prefill generation the page addresses belong to  */

/* decode node */
mtype:state ds[NREQ];
byte dgen;                  /* decode process generation                        */
byte rdg[NREQ];             /* dgen+1 of the decode process that admitted r     */
byte dn[NREQ];              /* pages reserved: prompt + GEN                     */
byte dbt[NREQ * ND];
byte dep[NREQ * ND];
byte dwm[NREQ];             /* written watermark, in pages (I3)                 */
bool dquar[NREQ];
bool pulled[NREQ];          /* decode started the pull                          */
bool verified[NREQ];        /* ghost: r passed VERIFY                           */

/* transfer engine: at most one pull per request */
mtype:xfer xst[NREQ];
byte xk[NREQ];              /* pages copied so far                              */
byte xc[NREQ];              /* completion notices queued for decode             */

/* fault budgets */
byte crashes, corruptions, duplicates;
#ifdef ADVERSARY
byte advs;                  /* adversary actions so far                         */
#endif

/* scratch for loops inside d_steps; hidden: not part of the state */
hidden byte ti, tj, tk, tp;
hidden mtype:event last_event;

#define PBT(r, k)  pbt[(r) * MAXP + (k)]
#define PEP(r, k)  pep[(r) * MAXP + (k)]
#define MSUM(r, k) msum[(r) * MAXP + (k)]
#define DBT(r, k)  dbt[(r) * ND + (k)]
#define DEP(r, k)  dep[(r) * ND + (k)]

#define FITS(r)      (plen[r] + GEN <= CTX)
#define TERMINAL(s)  ((s) == REJECTED || (s) == FINISHED || (s) == ABORTED)
#define SETTLED(s)   ((s) == NEW || TERMINAL(s))

/* ------------------------------------------------------- the state table
 * advance() is the only way a request's state changes. FROM, EVENT and TO
 * are literal names, so the test can compare every use with the Python
 * table. It is a macro, not an inline, so that with -DCOVERAGE each use
 * prints "COVER <var> <FROM> <EVENT> <TO>" the first time the search runs
 * it, and REACHED(name) prints "REACHED <name>": the test checks that every
 * transition and every marked scenario is reachable (no vacuous proof).
 * "@<line>" says where in this file. */
#ifdef COVERAGE
c_code {
    static char cover_seen[128][64];
    static int cover_n;
    static void cover_hit(int line, const char *what) {
        char t[64];
        int i;
        snprintf(t, sizeof t, "%s @%d", what, line);
        for (i = 0; i < cover_n; i++) if (!strcmp(cover_seen[i], t)) return;
        if (cover_n < 128) strcpy(cover_seen[cover_n++], t);
        printf("%s\n", t);
    }
}
#define COVER(var, FROM, EVENT, TO) \
    c_code { cover_hit(__LINE__, "COVER " #var " " #FROM " " #EVENT " " #TO); };
#define REACHED(name) c_code { cover_hit(__LINE__, "REACHED " #name); }
#else
#define COVER(var, FROM, EVENT, TO)
#define REACHED(name) skip
#endif

/* last_event is hidden (not part of the state); assigning EVENT to it makes
   spin check that EVENT is a name in mtype:event */
#define advance(var, FROM, EVENT, TO) \
    assert(var == FROM); COVER(var, FROM, EVENT, TO) last_event = EVENT; var = TO

/* ----------------------------------------------------- page pool (ledger) */

/* I6 at reuse time: no running pull still has page ti ahead of it. In the
 * prefill pool only pulls whose handle points into the running process
 * count (the others fail on the stale address, see Transfer). */
inline check_pp_not_under_transfer() {
    tp = 0;
    do
    :: tp < NREQ ->
        if
        :: xst[tp] == X_RUN && mgen[tp] == pgen ->
            tk = xk[tp];
            do
            :: tk < mcount[tp] ->
                CHECK(I6_no_reuse_under_transfer, PBT(tp, tk) != ti); tk++
            :: else -> break
            od
        :: else
        fi;
        tp++
    :: else -> break
    od
}
inline check_dp_not_under_transfer() {
    tp = 0;
    do
    :: tp < NREQ ->
        if
        :: xst[tp] == X_RUN ->
            tk = xk[tp];
            do
            :: tk < mcount[tp] ->
                CHECK(I6_no_reuse_under_transfer, DBT(tp, tk) != ti); tk++
            :: else -> break
            od
        :: else
        fi;
        tp++
    :: else -> break
    od
}

/* give r the first cnt FREE pages (the caller checked that there are
 * enough) and record owner and epoch (I1) */
inline prefill_alloc(r, cnt) {
    CHECK(I4_no_resources_after_reject, ps[r] != REJECTED);
    tj = 0; ti = 0;
    do
    :: tj == cnt -> break
    :: else ->
        if
        :: pp[ti].st == FREE ->
            CHECK(I1_alloc_free_page_only, pp[ti].owner == NOBODY);
            if
            :: pp[ti].data < NREQ && pp[ti].data != r ->
                REACHED(prefill_page_reused_holding_other_tenants_kv)
            :: else
            fi;
            PBT(r, tj) = ti; PEP(r, tj) = pp[ti].epoch; tj++;
            check_pp_not_under_transfer();
            pp[ti].st = OWNED; pp[ti].owner = r; pfree--
        :: else
        fi;
        ti++
    od;
    pn[r] = cnt
}
inline decode_alloc(r, cnt) {
    CHECK(I4_no_resources_after_reject, ds[r] != REJECTED);
    tj = 0; ti = 0;
    do
    :: tj == cnt -> break
    :: else ->
        if
        :: dp[ti].st == FREE ->
            CHECK(I1_alloc_free_page_only, dp[ti].owner == NOBODY);
            if
            :: dp[ti].data < NREQ && dp[ti].data != r ->
                REACHED(decode_page_reused_holding_other_tenants_kv)
            :: else
            fi;
            DBT(r, tj) = ti; DEP(r, tj) = dp[ti].epoch; tj++;
            check_dp_not_under_transfer();
            dp[ti].st = OWNED; dp[ti].owner = r; dfree--
        :: else
        fi;
        ti++
    od;
    dn[r] = cnt
}

/* free: owner record cleared, epoch bumped; the data stays (no scrub) */
inline prefill_free(r) {
    ti = 0;
    do
    :: ti < pn[r] ->
        CHECK(I1_free_own_page_only,
              pp[PBT(r, ti)].owner == r && pp[PBT(r, ti)].epoch == PEP(r, ti) &&
              pp[PBT(r, ti)].st != FREE);
        pp[PBT(r, ti)].st = FREE; pp[PBT(r, ti)].owner = NOBODY;
        pp[PBT(r, ti)].epoch++; pfree++;
        ti++
    :: else -> break
    od;
    pn[r] = 0; pquar[r] = 0
}
inline decode_free(r) {
    ti = 0;
    do
    :: ti < dn[r] ->
        CHECK(I1_free_own_page_only,
              dp[DBT(r, ti)].owner == r && dp[DBT(r, ti)].epoch == DEP(r, ti) &&
              dp[DBT(r, ti)].st != FREE);
        dp[DBT(r, ti)].st = FREE; dp[DBT(r, ti)].owner = NOBODY;
        dp[DBT(r, ti)].epoch++; dfree++;
        ti++
    :: else -> break
    od;
    dn[r] = 0; dquar[r] = 0
}

/* quarantine: the owner record stays, and nobody may allocate the page */
inline prefill_quarantine(r) {
    ti = 0;
    do
    :: ti < pn[r] -> pp[PBT(r, ti)].st = QUARANTINED; ti++
    :: else -> break
    od;
    pquar[r] = 1
}
inline decode_quarantine(r) {
    ti = 0;
    do
    :: ti < dn[r] -> dp[DBT(r, ti)].st = QUARANTINED; ti++
    :: else -> break
    od;
    dquar[r] = 1
}

/* a process restart: a new ledger, every page free, epochs move on; the
 * memory keeps whatever it held */
inline wipe_pp() {
    ti = 0;
    do
    :: ti < NP -> pp[ti].st = FREE; pp[ti].owner = NOBODY; pp[ti].epoch++; ti++
    :: else -> break
    od;
    pfree = NP
}
inline wipe_dp() {
    ti = 0;
    do
    :: ti < ND -> dp[ti].st = FREE; dp[ti].owner = NOBODY; dp[ti].epoch++; ti++
    :: else -> break
    od;
    dfree = ND
}

/* ------------------------------------------------------ housekeeping
 * Once request r is settled everywhere (answered, terminal or never seen on
 * both nodes, nothing quarantined, no pull running), no step reads its
 * bookkeeping again: zero it, so that runs differing only in dead values
 * are one state. Leftover messages and notices are dropped here too.
 * Called at the end of every step. */
#ifdef ADVERSARY
/* The adversary reads every registered page at every moment: prefill's held rows (a
 * KV_HELD request's, or quarantined) and decode's rows of requests awaiting KV. None may
 * hold a tenant's KV in the clear. (Pages being computed or decoded are the code's
 * private pool pages; free rows are zeroed in the code, and never read here.) */
inline adversary_reads() {
    tj = 0;
    do
    :: tj < NP ->
        if
        :: pp[tj].st == QUARANTINED || (pp[tj].st == OWNED && ps[pp[tj].owner] == KV_HELD) ->
            CHECK(I10_network_reads_see_no_plaintext, pp[tj].sr != NOBODY || pp[tj].data >= NREQ)
        :: else
        fi;
        tj++
    :: else -> break
    od;
    tj = 0;
    do
    :: tj < ND ->
        if
        :: dp[tj].st == OWNED && ds[dp[tj].owner] == AWAITING_KV ->
            CHECK(I10_network_reads_see_no_plaintext, dp[tj].sr != NOBODY || dp[tj].data >= NREQ)
        :: else
        fi;
        tj++
    :: else -> break
    od
}
#define ADV_READS adversary_reads();
#else
#define ADV_READS
#endif

inline reap() {
    ADV_READS
    tp = 0;
    do
    :: tp < NREQ ->
        if
        :: rt[tp] == RT_DONE && SETTLED(ps[tp]) && SETTLED(ds[tp]) &&
           !pquar[tp] && !dquar[tp] && xst[tp] != X_RUN ->
            to_p[tp] = 0; to_d[tp] = 0; to_r[tp] = 0;
            expired[tp] = 0; mcount[tp] = 0; mgen[tp] = 0; rdg[tp] = 0;
            dwm[tp] = 0; pulled[tp] = 0; xst[tp] = X_IDLE; xk[tp] = 0; xc[tp] = 0;
            tj = 0;
            do
            :: tj < MAXP -> PBT(tp, tj) = 0; PEP(tp, tj) = 0; MSUM(tp, tj) = 0; tj++
            :: else -> break
            od;
            tj = 0;
            do
            :: tj < ND -> DBT(tp, tj) = 0; DEP(tp, tj) = 0; tj++
            :: else -> break
            od
        :: else
        fi;
        tp++
    :: else -> break
    od;
    skip    /* a d_step must not end in a loop's break */
}

/* ----------------------------------------------------------------- reads */

/* decode attends slots [0, upto) of its block table */
inline attend(r, upto) {
    ti = 0;
    do
    :: ti < upto ->
        CHECK(I5_decode_after_verified_transfer, verified[r]);
        CHECK(I2_reader_owns_page,
              dp[DBT(r, ti)].owner == r && dp[DBT(r, ti)].epoch == DEP(r, ti) &&
              dp[DBT(r, ti)].st == OWNED);
        CHECK(I3_reads_written_slots_only, ti < dwm[r]);
#ifdef ADVERSARY
        CHECK(I10_attention_reads_no_foreign_bytes, dp[DBT(r, ti)].data != ADV);
#endif
        CHECK(I2_reader_reads_own_data, dp[DBT(r, ti)].data == r);
        ti++
    :: else -> break
    od
}

/* --------------------------------------------------- failure reporting
 * The router relays every failure to the other side at once (its own
 * messages are not modelled as in flight; see README). */

/* prefill failed r after the handle may have left */
inline prefill_failed(r) {
    if
    :: rt[r] == RT_PREFILL -> rt[r] = RT_DONE; cl[r] = C_ERR; to_r[r] = 0
    :: rt[r] == RT_DECODE  -> to_d[r] = to_d[r] | D_ABORT
    :: else
    fi
}
/* decode failed r; quiet: decode will never read r's prefill pages again */
inline decode_failed(r, quiet) {
    if
    :: rt[r] == RT_DECODE -> rt[r] = RT_DONE; cl[r] = C_ERR
    :: else
    fi;
    if
    :: quiet  -> to_p[r] = to_p[r] | P_DSTOP
    :: !quiet -> to_p[r] = to_p[r] | P_ABORT
    fi
}

/* ================================================================= ROUTER */

proctype Router(byte r) {
end:
    do
    /* 1. admission against the checked cluster capacity (I4, I8) */
    :: d_step { rt[r] == RT_NEW && !FITS(r) ->
            rt[r] = RT_DONE; cl[r] = C_400; REACHED(client_gets_400); reap() }
    /* 2. to prefill, which admits again (I4): it must reject what does not
          fit and may reject anything (tenant limits, a smaller pool after a
          restart, ...). The request's arrival and prefill's decision are one
          step, and so are the handle's arrival and decode's decision (3). */
    :: d_step { rt[r] == RT_NEW && FITS(r) ->
            rt[r] = RT_PREFILL;
            advance(ps[r], NEW, ADMIT, WAITING); reap() }
    :: d_step { rt[r] == RT_NEW && FITS(r) ->
            advance(ps[r], NEW, REJECT, REJECTED);
#ifdef MUTANT_A
            /* MUTANT A (the incident): the rejected prompt is replaced by a
               one-page placeholder and the handoff runs anyway */
            prefill_alloc(r, 1);
            pp[PBT(r, 0)].data = r;
            mcount[r] = 1; MSUM(r, 0) = r; mgen[r] = pgen;
            rt[r] = RT_PREFILL; to_r[r] = R_HANDLE;
#else
            rt[r] = RT_DONE; cl[r] = C_ERR;     /* the error goes to the client */
#endif
            reap() }
    /* 3. the handle goes to decode, which admits again (I4) */
    :: d_step { rt[r] == RT_PREFILL && (to_r[r] & R_HANDLE) && FITS(r) ->
            to_r[r] = 0; rt[r] = RT_DECODE;
            CHECK(I4_no_handoff_after_reject, ps[r] != REJECTED && FITS(r));
            advance(ds[r], NEW, ADMIT, WAITING);
            rdg[r] = dgen + 1; reap() }
    :: d_step { rt[r] == RT_PREFILL && (to_r[r] & R_HANDLE) ->
            to_r[r] = 0;
            CHECK(I4_no_handoff_after_reject, ps[r] != REJECTED && FITS(r));
            advance(ds[r], NEW, REJECT, REJECTED);
            rt[r] = RT_DONE; cl[r] = C_ERR;
            to_p[r] = to_p[r] | P_DSTOP;        /* decode never read: free */
            reap() }
    /* client disconnect, at any stage */
    :: d_step { rt[r] == RT_PREFILL ->
            rt[r] = RT_DONE; cl[r] = C_GONE; to_r[r] = 0;
            to_p[r] = to_p[r] | P_ABORT; reap() }
    :: d_step { rt[r] == RT_DECODE ->
            rt[r] = RT_DONE; cl[r] = C_GONE;
            to_p[r] = to_p[r] | P_ABORT; to_d[r] = to_d[r] | D_ABORT; reap() }
    od
}

/* ================================================================ PREFILL */

proctype Prefill(byte r) {
end:
    do
    /* pages from the pool, each with an owner record (I1) */
    :: d_step { ps[r] == WAITING && pfree >= plen[r] ->
            if :: pn[1 - r] > 0 -> REACHED(prefill_pool_shared_by_both) :: else fi;
            advance(ps[r], WAITING, SCHEDULE, PREFILLING);
            prefill_alloc(r, plen[r]); reap() }
    /* compute the prompt's KV (it writes the pages), hold the pages under a
       lease, and give the router a handle + manifest */
    :: d_step { ps[r] == PREFILLING ->
            ti = 0;
            do
            :: ti < pn[r] ->
                CHECK(I2_writer_owns_page,
                      pp[PBT(r, ti)].owner == r && pp[PBT(r, ti)].st == OWNED);
                pp[PBT(r, ti)].data = r; MSUM(r, ti) = r;
#ifdef ADVERSARY
                pp[PBT(r, ti)].sr = NOBODY;   /* computed in the clear (private pool) ... */
#ifdef MUTANT_E
                /* MUTANT E: ... and left in the clear in the registered row */
                skip;
#else
                /* ... then sealed under the hold's key (request, generation) and the
                   page's header (its epoch) */
                pp[PBT(r, ti)].sr = r; pp[PBT(r, ti)].se = pp[PBT(r, ti)].epoch; pp[PBT(r, ti)].sg = pgen;
#endif
#endif
                ti++
            :: else -> break
            od;
            mcount[r] = pn[r]; mgen[r] = pgen;
            advance(ps[r], PREFILLING, HOLD_KV, KV_HELD);
            if
            :: rt[r] == RT_PREFILL -> to_r[r] = R_HANDLE
            :: else
            fi;
            reap() }
    /* aborts before the handle exists: nobody else can touch the pages */
    :: d_step { ps[r] == WAITING && (to_p[r] & P_ABORT) ->
            to_p[r] = to_p[r] & ~P_ABORT;
            advance(ps[r], WAITING, ABORT, ABORTED); reap() }
    :: d_step { ps[r] == PREFILLING && (to_p[r] & P_ABORT) ->
            to_p[r] = to_p[r] & ~P_ABORT;
            advance(ps[r], PREFILLING, ABORT, ABORTED);
            prefill_free(r); reap() }
    /* decode verified the transfer: release */
    :: d_step { ps[r] == KV_HELD && (to_p[r] & P_ACK) ->
            to_p[r] = to_p[r] & ~P_ACK;
            advance(ps[r], KV_HELD, RELEASE, FINISHED);
            prefill_free(r); reap() }
    /* decode gave up and confirms it reads no more: free at once */
    :: d_step { ps[r] == KV_HELD && (to_p[r] & P_DSTOP) ->
            to_p[r] = to_p[r] & ~P_DSTOP;
            advance(ps[r], KV_HELD, ABORT, ABORTED);
            prefill_free(r); reap() }
    /* abort while decode may still read: quarantine (I6) */
    :: d_step { ps[r] == KV_HELD && (to_p[r] & P_ABORT) ->
            to_p[r] = to_p[r] & ~P_ABORT;
            advance(ps[r], KV_HELD, ABORT, ABORTED);
            prefill_quarantine(r); prefill_failed(r); reap() }
    /* the lease deadline passes while the pages are held: abort */
    :: d_step { ps[r] == KV_HELD ->
            if :: xst[r] == X_RUN -> REACHED(lease_expires_during_pull) :: else fi;
            expired[r] = 1;
            advance(ps[r], KV_HELD, ABORT, ABORTED);
#ifdef MUTANT_D
            /* MUTANT D: expiry frees the pages without a fence, although a
               pull that decode started before the deadline may still read */
            prefill_free(r);
#else
            prefill_quarantine(r);
#endif
            prefill_failed(r); reap() }
    /* ... or while they sit in quarantine */
    :: d_step { pquar[r] && !expired[r] -> expired[r] = 1; reap() }
    /* fence: quarantined pages are freed once decode confirms it stopped
       (ACK or DSTOP), or the decode process that took the request is gone,
       or the fence time has passed: the deadline is gone by (no pull can
       start) and no pull is still running (pulls are bounded in time) */
    :: d_step { pquar[r] &&
                ((to_p[r] & (P_ACK | P_DSTOP)) ||
                 (rdg[r] != 0 && rdg[r] != dgen + 1) ||
                 (expired[r] && xst[r] != X_RUN)) ->
            if
            :: to_p[r] & (P_ACK | P_DSTOP) -> REACHED(prefill_fence_decode_confirmed)
            :: else ->
                if
                :: rdg[r] != 0 && rdg[r] != dgen + 1 -> REACHED(prefill_fence_decode_gone)
                :: else -> REACHED(prefill_fence_time_passed)
                fi
            fi;
            to_p[r] = to_p[r] & ~(P_ACK | P_DSTOP);
            prefill_free(r); reap() }
    od
}

/* ================================================================= DECODE */

proctype Decode(byte r) {
end:
    do
    /* reserve prompt + generation pages, owner = this request (I1) */
    :: d_step { ds[r] == WAITING && dfree >= plen[r] + GEN ->
            if :: dn[1 - r] > 0 -> REACHED(decode_pool_shared_by_both) :: else fi;
            advance(ds[r], WAITING, RESERVE, AWAITING_KV);
            decode_alloc(r, plen[r] + GEN); reap() }
    :: d_step { ds[r] == WAITING && (to_d[r] & D_ABORT) ->
            to_d[r] = to_d[r] & ~D_ABORT;
            advance(ds[r], WAITING, ABORT, ABORTED);
            decode_failed(r, 1); reap() }
    /* start the one-sided pull, only before the handle's deadline */
    :: d_step { ds[r] == AWAITING_KV && !pulled[r] && !expired[r] ->
            CHECK(I4_no_handoff_after_reject, ps[r] != REJECTED && FITS(r));
            pulled[r] = 1; xst[r] = X_RUN; reap() }
    /* a completion notice while waiting: verify everything (I5) */
    :: d_step { ds[r] == AWAITING_KV && xc[r] > 0 ->
            xc[r]--;
            /* every manifest page arrived, the token count is the one the
               router asked for, and every checksum matches */
            tj = (xst[r] == X_OK && xk[r] == mcount[r] && mcount[r] == plen[r]);
            tk = 1; ti = 0;
            do
            :: ti < mcount[r] ->
#ifdef ADVERSARY
                /* the AEAD tag: the page opens only under the binding the manifest
                   names, and only if its bytes are the ones sealed (not GARBAGE or
                   ADV). Opened once, from a private copy: see the adversary's writes */
#ifdef MUTANT_F
                /* MUTANT F: the key is not bound to the request */
                tk = tk && dp[DBT(r, ti)].data != GARBAGE && dp[DBT(r, ti)].data != ADV &&
                     dp[DBT(r, ti)].se == PEP(r, ti) && dp[DBT(r, ti)].sg == mgen[r];
#else
                tk = tk && dp[DBT(r, ti)].data != GARBAGE && dp[DBT(r, ti)].data != ADV &&
                     dp[DBT(r, ti)].sr == r && dp[DBT(r, ti)].se == PEP(r, ti) && dp[DBT(r, ti)].sg == mgen[r];
#endif
#else
                tk = tk && dp[DBT(r, ti)].data == MSUM(r, ti);
#endif
                ti++
            :: else -> break
            od;
            if
            :: !tj -> REACHED(verify_rejects_failed_transfer)
            :: tj && !tk -> REACHED(verify_rejects_checksum_mismatch)
            :: else
            fi;
            tj = tj && tk;
            if
            :: tj ->
                advance(ds[r], AWAITING_KV, VERIFY, DECODING);
                /* the ground truth the checks must have established */
                ti = 0;
                do
                :: ti < plen[r] ->
                    CHECK(I5_decode_after_verified_transfer,
                          dp[DBT(r, ti)].data == r && dp[DBT(r, ti)].owner == r &&
                          dp[DBT(r, ti)].epoch == DEP(r, ti));
                    ti++
                :: else -> break
                od;
                verified[r] = 1; dwm[r] = mcount[r];
                to_p[r] = to_p[r] | P_ACK
            :: else ->
                /* failed, partial or mismatched; the pull is over: free */
                advance(ds[r], AWAITING_KV, ABORT, ABORTED);
                decode_free(r); decode_failed(r, 1)
            fi;
            reap() }
    /* a completion notice after an abort: the pull is over, lift the
       quarantine. In any other state a notice (late or duplicated) is
       dropped. */
    :: d_step { xc[r] > 0 && ds[r] != AWAITING_KV ->
            xc[r]--;
            if
            :: dquar[r] ->
                REACHED(decode_fence_late_notice);
                decode_free(r); to_p[r] = to_p[r] | P_DSTOP
            :: else -> REACHED(late_or_duplicate_notice_dropped)
            fi;
            reap() }
    /* give up: transfer timeout, handle expired, abort from the router or
       relayed from prefill */
    :: d_step { ds[r] == AWAITING_KV ->
            to_d[r] = to_d[r] & ~D_ABORT;
            advance(ds[r], AWAITING_KV, ABORT, ABORTED);
            if
            :: pulled[r] ->
                if :: xst[r] == X_RUN -> REACHED(decode_aborts_during_pull) :: else fi;
#ifdef MUTANT_C
                /* MUTANT C: the pages are freed although the pull may still
                   write into them (the late-write race) */
                decode_free(r);
#else
                decode_quarantine(r);   /* the pull may still write (I6) */
#endif
                decode_failed(r, 0)
            :: else ->
                if :: expired[r] -> REACHED(decode_gives_up_on_expired_handle) :: else fi;
                decode_free(r); decode_failed(r, 1)
            fi;
            reap() }
    /* one decode step: attend the written slots, write the next one */
    :: d_step { ds[r] == DECODING && dwm[r] < dn[r] ->
#ifdef MUTANT_B
            /* MUTANT B: attend the reserved length, not the written one */
            attend(r, dn[r]);
#else
            attend(r, dwm[r]);
#endif
            CHECK(I2_writer_owns_page,
                  dp[DBT(r, dwm[r])].owner == r && dp[DBT(r, dwm[r])].st == OWNED);
            dp[DBT(r, dwm[r])].data = r; dwm[r]++; reap() }
    :: d_step { ds[r] == DECODING && dwm[r] == dn[r] ->
            advance(ds[r], DECODING, FINISH, FINISHED);
            decode_free(r);
            if
            :: rt[r] == RT_DECODE -> rt[r] = RT_DONE; cl[r] = C_OK; REACHED(client_gets_200)
            :: else
            fi;
            reap() }
    :: d_step { ds[r] == DECODING && (to_d[r] & D_ABORT) ->
            to_d[r] = to_d[r] & ~D_ABORT;
            advance(ds[r], DECODING, ABORT, ABORTED);
            decode_free(r);
            if
            :: rt[r] == RT_DECODE -> rt[r] = RT_DONE; cl[r] = C_ERR
            :: else
            fi;
            reap() }
    od
}

/* ======================================================== TRANSFER ENGINE */

inline copy_checks(r) {
    /* the read, on behalf of r, of prefill's page (I2) */
    CHECK(I2_reader_owns_page,
          pp[PBT(r, xk[r])].owner == r && pp[PBT(r, xk[r])].epoch == PEP(r, xk[r]));
#ifdef ADVERSARY
    /* a one-sided read copies whatever the row holds; bytes the adversary put there
       (its own, or a row sealed for someone else) are only ciphertext to decode */
    CHECK(I2_reader_reads_own_data, pp[PBT(r, xk[r])].data == r || pp[PBT(r, xk[r])].data == ADV ||
                                    pp[PBT(r, xk[r])].sr != r);
#else
    CHECK(I2_reader_reads_own_data, pp[PBT(r, xk[r])].data == r);
#endif
    /* the write into decode's page (I6) */
    CHECK(I6_transfer_writes_own_page,
          dp[DBT(r, xk[r])].owner == r && dp[DBT(r, xk[r])].epoch == DEP(r, xk[r]) &&
          dp[DBT(r, xk[r])].st != FREE);
    if :: pp[PBT(r, xk[r])].st == QUARANTINED -> REACHED(pull_reads_quarantined_page) :: else fi;
    if :: dp[DBT(r, xk[r])].st == QUARANTINED -> REACHED(pull_writes_quarantined_page) :: else fi
}

proctype Transfer(byte r) {
end:
    do
    /* copy the next page, while the handle's addresses still belong to the
       running prefill process (a restarted one has new registrations) */
    :: d_step { xst[r] == X_RUN && xk[r] < mcount[r] && mgen[r] == pgen ->
            copy_checks(r);
            dp[DBT(r, xk[r])].data = pp[PBT(r, xk[r])].data;
#ifdef ADVERSARY
            dp[DBT(r, xk[r])].sr = pp[PBT(r, xk[r])].sr; dp[DBT(r, xk[r])].se = pp[PBT(r, xk[r])].se;
            dp[DBT(r, xk[r])].sg = pp[PBT(r, xk[r])].sg;
#endif
            xk[r]++; reap() }
    /* ... or copy it corrupted */
    :: d_step { xst[r] == X_RUN && xk[r] < mcount[r] && mgen[r] == pgen &&
                corruptions < CORRUPTIONS ->
            copy_checks(r);
            corruptions++;
            dp[DBT(r, xk[r])].data = GARBAGE; xk[r]++; reap() }
    :: d_step { xst[r] == X_RUN && xk[r] == mcount[r] ->
            xst[r] = X_OK; xc[r] = 1; reap() }
    /* failure at any point: network error, stale address after a prefill
       restart, or the engine's own hard timeout */
    :: d_step { xst[r] == X_RUN ->
            if :: mgen[r] != pgen -> REACHED(pull_fails_on_stale_handle) :: else fi;
            xst[r] = X_FAIL; xc[r] = 1; reap() }
    /* the notice is delivered twice */
    :: d_step { xst[r] == X_RUN && xk[r] == mcount[r] && duplicates < DUPLICATES ->
            duplicates++; xst[r] = X_OK; xc[r] = 2; reap() }
    od
}

/* ============================================================ ADVERSARY */

#ifdef ADVERSARY
/* may the adversary write prefill page i / decode page i? Registered memory only: not a
 * page being computed (prefill's private pool), nor one being decoded after VERIFY
 * (decode's private pool: the pulled rows were opened once into it). MUTANT_G lets it
 * write those too: decode reading the registered rows again after verifying them. */
#define PP_WRITABLE(i) (pp[i].st != OWNED || ps[pp[i].owner] != PREFILLING)
#define DP_WRITABLE(i) (dp[i].st != OWNED || ds[dp[i].owner] != DECODING)

proctype Adversary() {
    byte i, j;
end:
    do
    /* overwrite a registered page with bytes of its own */
    :: d_step { advs < ADVS -> advs++;
            i = 0;
            if
            :: i = 0 :: i = 1
            fi;
            if :: PP_WRITABLE(i) -> pp[i].data = ADV :: else fi;
            i = 0; j = 0; reap() }
    :: d_step { advs < ADVS -> advs++;
            i = 0;
            if
            :: i = 0 :: i = 1 :: i = 2 :: i = 3
            fi;
            if
#ifdef MUTANT_G
            /* MUTANT G: what decode attends is still the registered rows */
            :: dp[i].data = ADV
#else
            :: DP_WRITABLE(i) -> dp[i].data = ADV
            :: else
#endif
            fi;
            i = 0; reap() }
    /* copy a sealed row over another one (a replay, or a splice of another request's
       row into this one's) */
    :: d_step { advs < ADVS -> advs++;
            i = 0; j = 0;
            if
            :: i = 0; j = 1 :: i = 1; j = 0
            fi;
            if
            :: PP_WRITABLE(j) && (pp[i].st != OWNED || ps[pp[i].owner] != PREFILLING) ->
                pp[j].data = pp[i].data; pp[j].sr = pp[i].sr; pp[j].se = pp[i].se; pp[j].sg = pp[i].sg
            :: else
            fi;
            i = 0; j = 0; reap() }
    :: d_step { advs < ADVS -> advs++;
            i = 0; j = 0;
            if
            :: i = 0 :: i = 1
            fi;
            if
            :: j = 0 :: j = 1 :: j = 2 :: j = 3
            fi;
            if
            :: DP_WRITABLE(j) && (pp[i].st != OWNED || ps[pp[i].owner] != PREFILLING) ->
                if :: pp[i].sr < NREQ && dp[j].st == OWNED && pp[i].sr != dp[j].owner ->
                        REACHED(adversary_splices_another_requests_row)
                :: else fi;
                dp[j].data = pp[i].data; dp[j].sr = pp[i].sr; dp[j].se = pp[i].se; dp[j].sg = pp[i].sg
            :: else
            fi;
            i = 0; j = 0; reap() }
    /* forge a control message: "decode stopped reading r" to prefill, which would free
       rows a pull may still read. Without the cluster credential it is refused (401). */
    :: d_step { advs < ADVS -> advs++;
#ifdef MUTANT_H
            to_p[0] = to_p[0] | P_DSTOP;
#endif
            REACHED(adversary_forges_a_control_message); reap() }
    od
}
#endif

/* ============================================================ ENVIRONMENT */

proctype Env() {
end:
    do
    /* the prefill process crashes and restarts empty */
    :: d_step { crashes < CRASHES &&
                (ps[0] == WAITING || ps[0] == PREFILLING || ps[0] == KV_HELD || pquar[0] ||
                 ps[1] == WAITING || ps[1] == PREFILLING || ps[1] == KV_HELD || pquar[1]) ->
            crashes++; pgen++;
            wipe_pp();
            tp = 0;
            do
            :: tp < NREQ ->
                if
                :: ps[tp] == WAITING    -> advance(ps[tp], WAITING, ABORT, ABORTED)
                :: ps[tp] == PREFILLING -> advance(ps[tp], PREFILLING, ABORT, ABORTED)
                :: ps[tp] == KV_HELD    -> advance(ps[tp], KV_HELD, ABORT, ABORTED)
                :: else
                fi;
                pn[tp] = 0; pquar[tp] = 0; to_p[tp] = 0;
                /* the router sees the connection drop */
                if
                :: rt[tp] == RT_PREFILL -> rt[tp] = RT_DONE; cl[tp] = C_ERR; to_r[tp] = 0
                :: rt[tp] == RT_DECODE  -> to_d[tp] = to_d[tp] | D_ABORT
                :: else
                fi;
                tp++
            :: else -> break
            od;
            reap() }
    /* the decode process crashes and restarts empty; its pulls die with it */
    :: d_step { crashes < CRASHES &&
                (ds[0] == WAITING || ds[0] == AWAITING_KV || ds[0] == DECODING || dquar[0] ||
                 ds[1] == WAITING || ds[1] == AWAITING_KV || ds[1] == DECODING || dquar[1]) ->
            crashes++; dgen++;
            wipe_dp();
            tp = 0;
            do
            :: tp < NREQ ->
                if
                :: ds[tp] == WAITING     -> advance(ds[tp], WAITING, ABORT, ABORTED)
                :: ds[tp] == AWAITING_KV -> advance(ds[tp], AWAITING_KV, ABORT, ABORTED)
                :: ds[tp] == DECODING    -> advance(ds[tp], DECODING, ABORT, ABORTED)
                :: else
                fi;
                if
                :: xst[tp] == X_RUN -> xst[tp] = X_FAIL
                :: else
                fi;
                xc[tp] = 0; dn[tp] = 0; dquar[tp] = 0; to_d[tp] = 0;
                if
                :: rt[tp] == RT_DECODE ->
                    rt[tp] = RT_DONE; cl[tp] = C_ERR; to_p[tp] = to_p[tp] | P_ABORT
                :: else
                fi;
                tp++
            :: else -> break
            od;
            reap() }
    od
}

/* ============================================================ QUIESCENCE
 * timeout: nothing else can move. Every run of this model is finite, so
 * every run ends here; these are the "eventually" properties, and an
 * invalid end state (deadlock) fails END_all_answered or END_all_terminal. */

proctype Watchdog() {
    timeout ->
    d_step {
        tp = 0;
        do
        :: tp < NREQ ->
            CHECK(END_all_answered, rt[tp] == RT_DONE && cl[tp] != C_WAIT);
            CHECK(END_all_terminal, SETTLED(ps[tp]) && SETTLED(ds[tp]));
            CHECK(END_no_transfer_running, xst[tp] != X_RUN);
            CHECK(END_200_only_after_decode,
                  cl[tp] != C_OK || (ds[tp] == FINISHED && verified[tp]));
            CHECK(END_400_iff_over_length, (cl[tp] == C_400) == !FITS(tp));
            tp++
        :: else -> break
        od;
        ti = 0;
        do
        :: ti < NP ->
            CHECK(END_no_page_leaked, pp[ti].st == FREE && pp[ti].owner == NOBODY); ti++
        :: else -> break
        od;
        ti = 0;
        do
        :: ti < ND ->
            CHECK(END_no_page_leaked, dp[ti].st == FREE && dp[ti].owner == NOBODY); ti++
        :: else -> break
        od;
        CHECK(END_no_page_leaked, pfree == NP && dfree == ND)
    }
}

/* ================================================================== START */

init {
    atomic {
        ti = 0;
        do
        :: ti < NP -> pp[ti].owner = NOBODY; pp[ti].st = FREE; pp[ti].data = OLD;
#ifdef ADVERSARY
            pp[ti].sr = OLD; pp[ti].sg = 255;   /* an earlier process's sealed rows */
#endif
            ti++
        :: else -> break
        od;
        ti = 0;
        do
        :: ti < ND -> dp[ti].owner = NOBODY; dp[ti].st = FREE; dp[ti].data = OLD;
#ifdef ADVERSARY
            dp[ti].sr = OLD; dp[ti].sg = 255;
#endif
            ti++
        :: else -> break
        od;
        ti = 0;
        do
        :: ti < NREQ ->
            rt[ti] = RT_NEW; cl[ti] = C_WAIT; ps[ti] = NEW; ds[ti] = NEW; xst[ti] = X_IDLE;
            ti++
        :: else -> break
        od;
        /* prompt lengths; the requests are symmetric, so only pairs with
           plen[0] <= plen[1] are explored */
        if
        :: plen[0] = 1; plen[1] = 1
        :: plen[0] = 1; plen[1] = 2
        :: plen[0] = 2; plen[1] = 2
        :: plen[0] = 1; plen[1] = LONG
        :: plen[0] = 2; plen[1] = LONG
        fi;
        run Router(0); run Router(1);
        run Prefill(0); run Prefill(1);
        run Decode(0); run Decode(1);
        run Transfer(0); run Transfer(1);
        run Env();
#ifdef ADVERSARY
        run Adversary();
#endif
        run Watchdog()
    }
}
