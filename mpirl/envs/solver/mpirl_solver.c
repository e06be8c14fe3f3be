/* mpirl_solver.c: the solver's side of mpirl's env-group protocol (see mpirl_solver.h and
 * mpirl/runtime/sim_link.py, whose numbers are repeated below). C99 and MPI, nothing else.
 *
 * It also compiles as C++ (mpicxx treats a .c file as C++), hence the casts of malloc.
 *
 * Every wait polls (MPI_Iprobe / MPI_Test): first a short spin that yields the core, then
 * sleeps doubling from 50 us to 1 ms, so a solver waiting for the next action costs next to no
 * CPU, and a rank that shares its core with the one it waits for lets that one run.
 */
#define _POSIX_C_SOURCE 200809L
#include "mpirl_solver.h"

#include <ctype.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* sim_link's tags and layouts (version 1). */
enum {
    TAG_SETUP = 7101, TAG_SETUP_JSON = 7102, TAG_COMMAND = 7103, TAG_REPLY = 7104,
    TAG_ERROR = 7105, TAG_END = 7106, TAG_HELLO = 7107, TAG_GO = 7108, TAG_INTERCOMM = 7109
};
enum { CODE_RESET = 1, CODE_STEP = 2, CODE_END = 3, CODE_PING = 4 };
enum {
    SETUP_LEN = 16, SETUP_MAGIC = 0, SETUP_VERSION = 1, SETUP_GROUP = 2, SETUP_MEMBER = 3,
    SETUP_GROUP_SIZE = 4, SETUP_OBS_SIZE = 5, SETUP_ACTION_SIZE = 6, SETUP_ACTION_KIND = 7,
    SETUP_SEED = 8, SETUP_ROLLOUT_RANK = 9, SETUP_JSON_BYTES = 10, SETUP_NUM_GROUPS = 11
};
enum { HELLO_BYTES = 256, COMMAND_HEADER = 2, REPLY_HEADER = 4 };
#define ERROR_SEQ (-1.0)
/* How long a solver waits for world rank 0's GO: twice mpirl's default startup_timeout_s, so
 * that mpirl's rank 0 is the one to name who is missing. */
#define GO_TIMEOUT_S 1200.0

struct mpirl_solver {
    int began_mpi;          /* mpirl_init called MPI_Init: mpirl_finalize calls MPI_Finalize */
    int world_rank;
    MPI_Comm solver_comm;   /* every solver process */
    MPI_Comm link;          /* intercommunicator to mpirl (remote: mpirl's ranks) */
    MPI_Comm group_comm;    /* this env group's k ranks */
    int64_t setup[SETUP_LEN];
    char *json;
    int rollout_rank;       /* remote rank that drives this group */
    int member;
    int ended;
    int exit_code;
    double last_arg;        /* the arg of the command being answered (REPLY's seq) */
    double *command;        /* COMMAND_HEADER + action size */
    double *reply;          /* REPLY_HEADER + obs size */
};

/* ---- waiting ---------------------------------------------------------------------------- */

typedef struct {
    struct timespec since;
    long sleep_ns;
} backoff;

static double seconds_since(const struct timespec *t) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)(now.tv_sec - t->tv_sec) + 1e-9 * (double)(now.tv_nsec - t->tv_nsec);
}

static void backoff_reset(backoff *b) {
    clock_gettime(CLOCK_MONOTONIC, &b->since);
    b->sleep_ns = 0;
}

static void backoff_sleep(backoff *b) {
    if (b->sleep_ns == 0) {
        if (seconds_since(&b->since) < 2e-3) { /* just after activity: answer fast */
            sched_yield();
            return;
        }
        b->sleep_ns = 50000;
    }
    struct timespec pause = {0, b->sleep_ns};
    nanosleep(&pause, NULL);
    b->sleep_ns = b->sleep_ns * 2 > 1000000 ? 1000000 : b->sleep_ns * 2;
}

static void wait_request(MPI_Request *request) {
    backoff b;
    backoff_reset(&b);
    int done = 0;
    MPI_Test(request, &done, MPI_STATUS_IGNORE);
    while (!done) {
        backoff_sleep(&b);
        MPI_Test(request, &done, MPI_STATUS_IGNORE);
    }
}

/* Wait for a message (source, tag) on comm; returns 1 with its status, or 0 when END from the
 * remote rank 0 of the link came first (end_status then holds it). */
static int wait_message(mpirl_solver *s, MPI_Comm comm, int source, int tag, MPI_Status *status) {
    backoff b;
    backoff_reset(&b);
    for (;;) {
        int found = 0;
        MPI_Iprobe(source, tag, comm, &found, status);
        if (found) return 1;
        MPI_Iprobe(0, TAG_END, s->link, &found, status);
        if (found) return 0;
        backoff_sleep(&b);
    }
}

static void take_end(mpirl_solver *s) {
    int64_t end[2] = {0, 0};
    MPI_Recv(end, 2, MPI_INT64_T, 0, TAG_END, s->link, MPI_STATUS_IGNORE);
    s->ended = 1;
    s->exit_code = (int)end[1];
}

static void die(const char *message) {
    fprintf(stderr, "%s\n", message);
    fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 2);
    exit(2);
}

/* ---- start-up --------------------------------------------------------------------------- */

static void program_name(char ***argv, char *out, size_t size) {
    out[0] = '\0';
    if (argv && *argv && (*argv)[0]) {
        snprintf(out, size, "%s", (*argv)[0]);
        return;
    }
    FILE *cmdline = fopen("/proc/self/cmdline", "r"); /* Fortran callers pass no argv */
    if (cmdline) {
        size_t n = fread(out, 1, size - 1, cmdline);
        out[n] = '\0';
        fclose(cmdline);
    }
}

static void hello_and_go(mpirl_solver *s, const char *program, int64_t go[2]) {
    char hello[HELLO_BYTES], host[128];
    memset(hello, 0, sizeof hello);
    if (gethostname(host, sizeof host) != 0) strcpy(host, "?");
    host[sizeof host - 1] = '\0';
    snprintf(hello, sizeof hello, "solver|%ld|%s|%s", (long)getpid(), host, program);
    MPI_Request sent;
    MPI_Isend(hello, HELLO_BYTES, MPI_CHAR, 0, TAG_HELLO, MPI_COMM_WORLD, &sent);
    backoff b;
    backoff_reset(&b);
    int found = 0;
    for (;;) {
        MPI_Iprobe(0, TAG_GO, MPI_COMM_WORLD, &found, MPI_STATUS_IGNORE);
        if (found) break;
        if (seconds_since(&b.since) > GO_TIMEOUT_S) {
            char message[300];
            snprintf(message, sizeof message, "mpirl_init: world rank %d waited %.0f s for "
                     "mpirl's world rank 0 to answer its start-up message; is world rank 0 an "
                     "mpirl command (mpiexec -n N mpirl ... : -n S %s)?", s->world_rank,
                     GO_TIMEOUT_S, program);
            die(message);
        }
        backoff_sleep(&b);
    }
    MPI_Recv(go, 2, MPI_INT64_T, 0, TAG_GO, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    wait_request(&sent);
}

/* Every solver process reports (group, member); all wait for all (polled, so an END can still
 * end the wait), then split by group. Returns 0, or MPIRL_END. */
static int form_group(mpirl_solver *s) {
    int size;
    MPI_Comm_size(s->solver_comm, &size);
    int mine[2] = {(int)s->setup[SETUP_GROUP], (int)s->setup[SETUP_MEMBER]};
    int *all = (int *)malloc(sizeof(int) * 2 * (size_t)size);
    MPI_Request request;
    MPI_Iallgather(mine, 2, MPI_INT, all, 2, MPI_INT, s->solver_comm, &request);
    backoff b;
    backoff_reset(&b);
    for (;;) {
        int done = 0, end = 0;
        MPI_Test(&request, &done, MPI_STATUS_IGNORE);
        if (done) break;
        MPI_Iprobe(0, TAG_END, s->link, &end, MPI_STATUS_IGNORE);
        if (end) { /* the run ended before every solver had its setup */
            free(all);
            take_end(s);
            return MPIRL_END;
        }
        backoff_sleep(&b);
    }
    int k = 0, k_expected = (int)s->setup[SETUP_GROUP_SIZE];
    for (int r = 0; r < size; r++) {
        if (all[2 * r] == mine[0]) k++;
    }
    free(all);
    if (k != k_expected) {
        char message[200];
        snprintf(message, sizeof message, "mpirl_init: env group %d has %d solver processes, "
                 "its setup says ranks_per_env %d", mine[0], k, k_expected);
        die(message);
    }
    MPI_Comm_split(s->solver_comm, mine[0], mine[1], &s->group_comm);
    return 0;
}

static int take_setup(mpirl_solver *s) {
    MPI_Status status;
    if (!wait_message(s, s->link, MPI_ANY_SOURCE, TAG_SETUP, &status)) {
        take_end(s);
        return MPIRL_END;
    }
    int source = status.MPI_SOURCE;
    MPI_Recv(s->setup, SETUP_LEN, MPI_INT64_T, source, TAG_SETUP, s->link, MPI_STATUS_IGNORE);
    if (s->setup[SETUP_MAGIC] != MPIRL_PROTOCOL_MAGIC ||
        s->setup[SETUP_VERSION] != MPIRL_PROTOCOL_VERSION) {
        char message[240];
        snprintf(message, sizeof message, "mpirl_init: the setup from mpirl's rank %d has magic "
                 "%#llx, version %lld; this solver speaks version %d (magic %#lx): rebuild it "
                 "with this mpirl's mpirl_solver.c", source,
                 (unsigned long long)s->setup[SETUP_MAGIC], (long long)s->setup[SETUP_VERSION],
                 MPIRL_PROTOCOL_VERSION, MPIRL_PROTOCOL_MAGIC);
        die(message);
    }
    int bytes = (int)s->setup[SETUP_JSON_BYTES];
    s->json = (char *)calloc((size_t)bytes + 1, 1);
    if (!wait_message(s, s->link, source, TAG_SETUP_JSON, &status)) {
        take_end(s);
        return MPIRL_END;
    }
    MPI_Recv(s->json, bytes, MPI_CHAR, source, TAG_SETUP_JSON, s->link, MPI_STATUS_IGNORE);
    s->rollout_rank = source;
    s->member = (int)s->setup[SETUP_MEMBER];
    s->command = (double *)calloc(COMMAND_HEADER + (size_t)s->setup[SETUP_ACTION_SIZE], sizeof(double));
    s->reply = (double *)calloc(REPLY_HEADER + (size_t)s->setup[SETUP_OBS_SIZE], sizeof(double));
    return form_group(s);
}

/* The launcher (srun, mpiexec, the job script) passes a stop request (SIGUSR1/2, SIGTERM) to
 * every process of the step, the solver's too. mpirl's ranks answer it by finishing their
 * iteration, which needs the solver, then checkpointing; mpirl then ENDs the solver. A solver
 * that died of the signal would leave that iteration without replies, and the checkpoint
 * unwritten. So what the solver has not claimed itself (SIG_DFL) is ignored here. */
static void leave_stop_signals_to_mpirl(void) {
    const int stops[] = {SIGUSR1, SIGUSR2, SIGTERM};
    for (size_t i = 0; i < sizeof stops / sizeof stops[0]; i++) {
        struct sigaction current;
        if (sigaction(stops[i], NULL, &current) == 0 && current.sa_handler == SIG_DFL) {
            struct sigaction ignore;
            memset(&ignore, 0, sizeof ignore);
            ignore.sa_handler = SIG_IGN;
            sigemptyset(&ignore.sa_mask);
            sigaction(stops[i], &ignore, NULL);
        }
    }
}

int mpirl_init(int *argc, char ***argv, mpirl_solver **solver) {
    leave_stop_signals_to_mpirl();
    mpirl_solver *s = (mpirl_solver *)calloc(1, sizeof *s);
    *solver = s;
    s->solver_comm = s->link = s->group_comm = MPI_COMM_NULL;
    s->json = NULL;
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
        MPI_Init(argc, argv);
        s->began_mpi = 1;
    }
    char program[HELLO_BYTES];
    program_name(argv, program, sizeof program);
    MPI_Comm_rank(MPI_COMM_WORLD, &s->world_rank);
    if (s->world_rank == 0) {
        char message[400];
        snprintf(message, sizeof message, "mpirl_init: %s is world rank 0, but an MPMD launch "
                 "starts mpirl first: mpiexec -n N mpirl ... : -n S %s", program, program);
        die(message);
    }
    int64_t go[2];
    hello_and_go(s, program, go);
    if (go[0] <= 0 || s->world_rank < go[1] || s->world_rank >= go[1] + go[0]) {
        char message[240];
        snprintf(message, sizeof message, "mpirl_init: world rank %d is not among the solver "
                 "processes mpirl counted (%lld from world rank %lld)", s->world_rank,
                 (long long)go[0], (long long)go[1]);
        die(message);
    }
    MPI_Comm_split(MPI_COMM_WORLD, 1, s->world_rank, &s->solver_comm);
    MPI_Intercomm_create(s->solver_comm, 0, MPI_COMM_WORLD, 0, TAG_INTERCOMM, &s->link);
    return take_setup(s);
}

/* ---- accessors -------------------------------------------------------------------------- */

MPI_Comm mpirl_group_comm(const mpirl_solver *s) { return s->group_comm; }
MPI_Comm mpirl_solver_comm(const mpirl_solver *s) { return s->solver_comm; }
int mpirl_group(const mpirl_solver *s) { return (int)s->setup[SETUP_GROUP]; }
int mpirl_num_groups(const mpirl_solver *s) { return (int)s->setup[SETUP_NUM_GROUPS]; }
int mpirl_obs_size(const mpirl_solver *s) { return (int)s->setup[SETUP_OBS_SIZE]; }
int mpirl_action_size(const mpirl_solver *s) { return (int)s->setup[SETUP_ACTION_SIZE]; }
long mpirl_seed(const mpirl_solver *s) { return (long)s->setup[SETUP_SEED]; }
int mpirl_exit_code(const mpirl_solver *s) { return s ? s->exit_code : 2; }
const char *mpirl_config_json(const mpirl_solver *s) { return s->json ? s->json : "{}"; }

/* The text after "key": in a flat JSON object, or NULL. */
static const char *config_value(const mpirl_solver *s, const char *key) {
    const char *json = mpirl_config_json(s);
    size_t length = strlen(key);
    for (const char *p = strchr(json, '"'); p; p = strchr(p + 1, '"')) {
        if (strncmp(p + 1, key, length) != 0 || p[1 + length] != '"') continue;
        const char *q = p + 2 + length;
        while (isspace((unsigned char)*q)) q++;
        if (*q != ':') continue; /* a string value equal to the key, not the key */
        q++;
        while (isspace((unsigned char)*q)) q++;
        return q;
    }
    return NULL;
}

double mpirl_config_double(const mpirl_solver *s, const char *key, double fallback) {
    const char *value = config_value(s, key);
    if (!value) return fallback;
    if (strncmp(value, "true", 4) == 0) return 1.0;
    if (strncmp(value, "false", 5) == 0) return 0.0;
    char *end;
    double number = strtod(value, &end);
    return end == value ? fallback : number;
}

long mpirl_config_long(const mpirl_solver *s, const char *key, long fallback) {
    const char *value = config_value(s, key);
    if (!value) return fallback;
    char *end;
    double number = strtod(value, &end);
    if (end == value) return (long)mpirl_config_double(s, key, (double)fallback);
    return (long)number;
}

/* ---- the loop --------------------------------------------------------------------------- */

static void send_reply(mpirl_solver *s) {
    MPI_Request request;
    MPI_Isend(s->reply, REPLY_HEADER + mpirl_obs_size(s), MPI_DOUBLE, s->rollout_rank,
              TAG_REPLY, s->link, &request);
    wait_request(&request);
}

/* The group root: the next RESET, STEP or END into s->command, answering PINGs on the way. */
static void root_receive(mpirl_solver *s) {
    int width = COMMAND_HEADER + mpirl_action_size(s);
    for (;;) {
        MPI_Status status;
        if (!wait_message(s, s->link, s->rollout_rank, TAG_COMMAND, &status)) {
            take_end(s);
            s->command[0] = CODE_END;
            s->command[1] = s->exit_code;
            return;
        }
        int count = 0;
        MPI_Get_count(&status, MPI_DOUBLE, &count);
        if (count != width) {
            char message[200];
            snprintf(message, sizeof message, "mpirl_next: a command of %d numbers; this "
                     "group's action size %d needs %d", count, mpirl_action_size(s), width);
            die(message);
        }
        MPI_Recv(s->command, width, MPI_DOUBLE, s->rollout_rank, TAG_COMMAND, s->link,
                 MPI_STATUS_IGNORE);
        if ((int)s->command[0] != CODE_PING) {
            if ((int)s->command[0] == CODE_END) s->command[1] = 0; /* a normal end: exit 0 */
            return;
        }
        memset(s->reply, 0, sizeof(double) * (size_t)(REPLY_HEADER + mpirl_obs_size(s)));
        s->reply[0] = s->command[1];
        send_reply(s);
    }
}

int mpirl_next(mpirl_solver *s, double *action, long *seed) {
    if (s->ended) return MPIRL_END;
    int width = COMMAND_HEADER + mpirl_action_size(s);
    if (s->member == 0) root_receive(s);
    int k;
    MPI_Comm_size(s->group_comm, &k);
    if (k > 1) {
        MPI_Request request;
        MPI_Ibcast(s->command, width, MPI_DOUBLE, 0, s->group_comm, &request);
        wait_request(&request);
    }
    int code = (int)s->command[0];
    s->last_arg = s->command[1];
    if (code == CODE_END) {
        s->ended = 1;
        s->exit_code = (int)s->command[1];
        return MPIRL_END;
    }
    if (code == CODE_RESET) {
        if (seed) *seed = (long)s->command[1];
    } else if (action) {
        memcpy(action, s->command + COMMAND_HEADER,
               sizeof(double) * (size_t)mpirl_action_size(s));
    }
    return code;
}

int mpirl_send(mpirl_solver *s, const double *obs, double reward, int terminated,
               int truncated) {
    if (s->ended) return MPIRL_END;
    if (s->member != 0) return 0;
    s->reply[0] = s->last_arg;
    s->reply[1] = reward;
    s->reply[2] = terminated ? 1.0 : 0.0;
    s->reply[3] = truncated ? 1.0 : 0.0;
    memcpy(s->reply + REPLY_HEADER, obs, sizeof(double) * (size_t)mpirl_obs_size(s));
    send_reply(s);
    return 0;
}

int mpirl_send_n(mpirl_solver *s, const double *obs, int n, double reward, int terminated,
                 int truncated) {
    if (n == mpirl_obs_size(s) || s->ended || s->member != 0)
        return mpirl_send(s, obs, reward, terminated, truncated);
    /* The wrong length: sent as it is, for mpirl's side to name (the run ends there). */
    int width = REPLY_HEADER + (n > 0 ? n : 0);
    double *reply = (double *)calloc((size_t)width, sizeof(double));
    reply[0] = s->last_arg;
    reply[1] = reward;
    reply[2] = terminated ? 1.0 : 0.0;
    reply[3] = truncated ? 1.0 : 0.0;
    if (n > 0) memcpy(reply + REPLY_HEADER, obs, sizeof(double) * (size_t)n);
    MPI_Request request;
    MPI_Isend(reply, width, MPI_DOUBLE, s->rollout_rank, TAG_REPLY, s->link, &request);
    wait_request(&request);
    free(reply);
    return 0;
}

int mpirl_fail(mpirl_solver *s, const char *message) {
    if (s->ended) return s->exit_code;
    s->ended = 1;
    s->exit_code = 2;
    if (s->member != 0) return s->exit_code;
    memset(s->reply, 0, sizeof(double) * (size_t)(REPLY_HEADER + mpirl_obs_size(s)));
    s->reply[0] = ERROR_SEQ;
    send_reply(s);
    const char *text = message ? message : "";
    size_t length = strcspn(text, "\n"); /* one line */
    MPI_Request request;
    MPI_Isend(text, (int)length, MPI_CHAR, s->rollout_rank, TAG_ERROR, s->link, &request);
    wait_request(&request);
    return s->exit_code;
}

int mpirl_finalize(mpirl_solver *s) {
    /* 0 whatever the run's code: mpirl's rank 0 exits with it, last, so that Open MPI's
     * launcher reports it without its "exited with non-zero status" note; a solver leaving
     * first with a non-zero code would have the launcher kill mpirl's ranks before they say
     * why the run ended. */
    if (!s) return 0;
    int code = 0;
    if (s->group_comm != MPI_COMM_NULL) MPI_Comm_free(&s->group_comm);
    if (s->solver_comm != MPI_COMM_NULL) MPI_Comm_free(&s->solver_comm);
    int began = s->began_mpi;
    free(s->json);
    free(s->command);
    free(s->reply);
    free(s);
    if (began) MPI_Finalize();
    return code;
}

/* ---- Fortran shims (mpirl.f90): handles as MPI_Fint, no argc/argv ---------------------- */

int mpirl_init_f(mpirl_solver **solver) { return mpirl_init(NULL, NULL, solver); }
MPI_Fint mpirl_group_comm_f(const mpirl_solver *s) { return MPI_Comm_c2f(s->group_comm); }
MPI_Fint mpirl_solver_comm_f(const mpirl_solver *s) { return MPI_Comm_c2f(s->solver_comm); }
