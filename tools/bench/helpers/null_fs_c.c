/* null_fs.py's kernel route compiled: a FUSE server that does no work, with no Python in its request loop.
 *
 * Built and started by `null_fs.py --fuse c` (never by hand): the Python side walks the source tree,
 * writes it as a table (format below), mounts, answers the kernel's INIT with blockfs's session code (so the
 * flags are the kernel route's to the bit), and then runs this program with the /dev/fuse descriptor
 * inherited.  It answers what null_fs.py's kernel route answers, the same bytes: LOOKUP (an entry or a
 * negative one), GETATTR, READDIRPLUS / READDIR (every child from the request's offset, as many as fit),
 * READ (zeros up to the file's size), STATFS, CPython's isatty ioctl (ENOTTY, before any dispatch, as
 * blockfs's session does), FORGET / BATCH_FORGET (nothing), everything else ENOSYS.  Timeouts are a day.
 *
 *     null_fs_c TABLE FD THREADS CLONE COUNTS
 *
 * THREADS workers read requests; CLONE=1 gives each worker but the first its own descriptor
 * (FUSE_DEV_IOC_CLONE), CLONE=0 has them share FD; CLONE=2 serves over io_uring instead (FUSE_OVER_IO_URING,
 * which the INIT answer must have asked for): a ring per CPU with THREADS entries, one worker on FD.  COUNTS ("" for none): at each SIGUSR1 the requests
 * received so far are written there as JSON, by opcode name, as null_fs.py's --counts does.  It never
 * unmounts: it exits when the mount goes (ENODEV) or at SIGTERM/SIGINT, and null_fs.py unmounts.
 *
 * TABLE, native-endian: "NULLFSC1", u64 nodes, u64 children, u64 name bytes; then per node (node id =
 * position + 1, the root first) u64 parent, u64 name offset, u32 name length, u32 child count, u64 first
 * child (index into the children array), then its 88-byte fuse_attr; then the children's node ids (u64, in
 * listing order); then the names.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/fuse.h>
#include <pthread.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <fcntl.h>
#include <unistd.h>

#define VALID 86400
#define BUFFER_BYTES (1 << 17) /* as blockfs's session: > max_write (64 KiB) + headers */
#define MAX_READ (1 << 20)     /* max_pages 256 */
#define OPCODES 64

struct node {
    uint64_t parent, name_off;
    uint32_t name_len, nchildren;
    uint64_t first_child;
    struct fuse_attr attr;
};

static struct node *nodes;
static uint64_t node_count, *children;
static const char *names;
static uint64_t *slots, slot_mask; /* open addressing: (parent, name) -> node id, 0 empty */
static const char zeros[MAX_READ];
static int main_fd;

struct worker {
    pthread_t thread;
    int fd;
    uint64_t counts[OPCODES];
};
static struct worker *workers;
static int worker_count;
static volatile int workers_left;

static uint64_t hash(uint64_t parent, const char *name, size_t len) {
    uint64_t h = 1469598103934665603ULL ^ parent;
    for (size_t i = 0; i < len; i++) h = (h ^ (unsigned char)name[i]) * 1099511628211ULL;
    return h;
}

static uint64_t find(uint64_t parent, const char *name, size_t len) {
    for (uint64_t i = hash(parent, name, len) & slot_mask;; i = (i + 1) & slot_mask) {
        uint64_t id = slots[i];
        if (id == 0) return 0;
        struct node *n = &nodes[id - 1];
        if (n->parent == parent && n->name_len == len && memcmp(names + n->name_off, name, len) == 0) return id;
    }
}

static void load(const char *path) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0) {
        perror(path);
        exit(2);
    }
    char *data = malloc(st.st_size);
    for (off_t got = 0; got < st.st_size;) {
        ssize_t n = read(fd, data + got, st.st_size - got);
        if (n <= 0) {
            perror(path);
            exit(2);
        }
        got += n;
    }
    close(fd);
    uint64_t head[3];
    if (st.st_size < 32 || memcmp(data, "NULLFSC1", 8) != 0) {
        fprintf(stderr, "%s: not a null_fs_c table\n", path);
        exit(2);
    }
    memcpy(head, data + 8, sizeof head);
    node_count = head[0];
    nodes = (struct node *)(data + 32);
    children = (uint64_t *)(data + 32 + node_count * sizeof(struct node));
    names = (const char *)(children + head[1]);
    uint64_t slot_count = 16;
    while (slot_count < 2 * node_count) slot_count <<= 1;
    slot_mask = slot_count - 1;
    slots = calloc(slot_count, sizeof *slots);
    for (uint64_t id = 2; id <= node_count; id++) { /* the root (1) has no name to look up */
        struct node *n = &nodes[id - 1];
        uint64_t i = hash(n->parent, names + n->name_off, n->name_len) & slot_mask;
        while (slots[i]) i = (i + 1) & slot_mask;
        slots[i] = id;
    }
}

/* One answer: header + body parts.  A failed write is a request interrupted (ENOENT) or a mount gone. */
static void answer(int fd, uint64_t unique, int error, struct iovec *iov, int parts) {
    struct fuse_out_header out = {.len = sizeof out, .error = error, .unique = unique};
    struct iovec all[4];
    all[0] = (struct iovec){&out, sizeof out};
    for (int i = 0; i < parts; i++) {
        all[i + 1] = iov[i];
        out.len += iov[i].iov_len;
    }
    if (writev(fd, all, parts + 1) < 0 && errno != ENOENT && errno != ENODEV && errno != EBADF)
        perror("answering the kernel");
}

static void entry_of(struct fuse_entry_out *e, uint64_t id) {
    memset(e, 0, sizeof *e);
    e->nodeid = id;
    e->entry_valid = e->attr_valid = VALID;
    e->attr = nodes[id - 1].attr;
}

/* READDIR(PLUS) of directory `dir`: the children from `offset` on, as many as fit in `size` bytes. */
static size_t listing(char *out, uint64_t dir, uint64_t offset, uint32_t size, int plus) {
    struct node *d = &nodes[dir - 1];
    size_t used = 0;
    for (uint64_t i = offset; i < d->nchildren; i++) {
        uint64_t id = children[d->first_child + i];
        struct node *c = &nodes[id - 1];
        size_t fixed = plus ? sizeof(struct fuse_entry_out) + FUSE_NAME_OFFSET : FUSE_NAME_OFFSET;
        size_t one = FUSE_REC_ALIGN(fixed + c->name_len);
        if (used + one > size) break;
        char *p = out + used;
        memset(p, 0, one);
        if (plus) {
            entry_of((struct fuse_entry_out *)p, id);
            p += sizeof(struct fuse_entry_out);
        }
        struct fuse_dirent *de = (struct fuse_dirent *)p;
        de->ino = id;
        de->off = i + 1;
        de->namelen = c->name_len;
        de->type = (c->attr.mode & 0170000) >> 12;
        memcpy(de->name, names + c->name_off, c->name_len);
        used += one;
    }
    return used;
}

/* The answer to request `in`: 0 or -errno, with the body in *reply (*reply_len bytes), or 1 for none
 * (FORGET).  `op` is the operation's own structure, `name` / `name_len` what follows it (a LOOKUP's name):
 * one buffer on /dev/fuse, two on the ring.  Listings are written into `out` (`out_len` bytes). */
static int handle(const struct fuse_in_header *in, const void *op_in, const char *name, size_t name_len, char *out,
                  size_t out_len, const void **reply, size_t *reply_len) {
    static __thread struct fuse_entry_out e;
    static __thread struct fuse_attr_out a;
    static __thread struct fuse_statfs_out s;
    uint64_t id = in->nodeid;
    int op = in->opcode;
    int on_node = op == FUSE_LOOKUP || op == FUSE_GETATTR || op == FUSE_READ || op == FUSE_READDIR ||
                  op == FUSE_READDIRPLUS;
    *reply_len = 0;
    if (on_node && (id == 0 || id > node_count)) return -ENOENT; /* never sent: every id was answered here */
    switch (op) {
    case FUSE_IOCTL: /* isatty() of every CPython < 3.14 open() */
        return -ENOTTY;
    case FUSE_LOOKUP: {
        uint64_t child = find(id, name, strnlen(name, name_len));
        if (child) {
            entry_of(&e, child);
        } else {
            memset(&e, 0, sizeof e);
            e.entry_valid = VALID; /* "no such name", remembered a day */
        }
        *reply = &e, *reply_len = sizeof e;
        return 0;
    }
    case FUSE_GETATTR:
        a = (struct fuse_attr_out){.attr_valid = VALID, .attr = nodes[id - 1].attr};
        *reply = &a, *reply_len = sizeof a;
        return 0;
    case FUSE_READ: {
        const struct fuse_read_in *r = op_in;
        uint64_t size = nodes[id - 1].attr.size, end = r->offset + r->size;
        if (end > size) end = size;
        size_t len = end > r->offset ? end - r->offset : 0;
        *reply = zeros, *reply_len = len > MAX_READ ? MAX_READ : len;
        return 0;
    }
    case FUSE_READDIRPLUS:
    case FUSE_READDIR: {
        const struct fuse_read_in *r = op_in;
        uint32_t size = r->size < out_len ? r->size : out_len;
        *reply = out, *reply_len = listing(out, id, r->offset, size, op == FUSE_READDIRPLUS);
        return 0;
    }
    case FUSE_STATFS:
        s = (struct fuse_statfs_out){.st = {.blocks = 1, .files = node_count, .bsize = 4096, .namelen = 255,
                                            .frsize = 4096}};
        *reply = &s, *reply_len = sizeof s;
        return 0;
    case FUSE_FORGET:
    case FUSE_BATCH_FORGET:
        return 1;
    default: /* OPEN, OPENDIR, INTERRUPT, GETXATTR, ...: as null_fs.py, not implemented */
        return -ENOSYS;
    }
}

static void *serve(void *arg) {
    struct worker *w = arg;
    int fd = w->fd;
    char *buf = malloc(BUFFER_BYTES), *list = malloc(BUFFER_BYTES);
    for (;;) {
        ssize_t n = read(fd, buf, BUFFER_BYTES);
        if (n < 0) {
            if (errno == EINTR || errno == ENOENT || errno == EAGAIN) continue;
            if (errno != ENODEV && errno != EBADF) perror("reading /dev/fuse");
            break;
        }
        if ((size_t)n < sizeof(struct fuse_in_header)) continue;
        struct fuse_in_header *in = (struct fuse_in_header *)buf;
        char *body = buf + sizeof *in;
        size_t body_len = n - sizeof *in;
        uint64_t unique = in->unique;
        if (in->opcode < OPCODES) w->counts[in->opcode]++;
        const void *reply = NULL;
        size_t reply_len = 0;
        int error = handle(in, body, body, body_len, list, BUFFER_BYTES, &reply, &reply_len);
        if (error <= 0) answer(fd, unique, error, &(struct iovec){(void *)reply, reply_len}, reply_len ? 1 : 0);
    }
    if (__atomic_sub_fetch(&workers_left, 1, __ATOMIC_SEQ_CST) == 0) kill(getpid(), SIGTERM);
    return NULL;
}


/* --- FUSE over io_uring (MODE 2) ------------------------------------------------------------------------
 * The ring's structures (protocol 7.42+; this machine's <linux/fuse.h> may predate them).  One queue per
 * possible CPU: the kernel hands a request to the queue of the CPU its caller runs on, and uses the ring only
 * once every queue holds an entry; FORGET and INTERRUPT still come through /dev/fuse (a legacy worker). */
#include <linux/io_uring.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/syscall.h>

struct ring_ent_in_out {
    uint64_t flags, commit_id;
    uint32_t payload_sz, padding;
    uint64_t reserved;
};
struct ring_header {
    char in_out[128]; /* fuse_in_header in, fuse_out_header back */
    char op_in[128];  /* the operation's own structure */
    struct ring_ent_in_out ent;
};
struct ring_cmd {
    uint64_t flags, commit_id;
    uint16_t qid;
    uint8_t padding[6];
};
#define RING_REGISTER 1
#define RING_COMMIT_AND_FETCH 2

struct ring_entry {
    struct ring_header header;
    struct iovec iov[2];
    char *payload;
};

struct uring_queue {
    pthread_t thread;
    int qid, entries;
    uint64_t counts[OPCODES];
};

static size_t ring_payload = MAX_READ; /* >= the kernel's max payload: max_pages (256) pages */
static struct uring_queue *queues;
static int queue_count;

static int possible_cpus(void) { /* the kernel's queue count: num_possible_cpus() */
    FILE *f = fopen("/sys/devices/system/cpu/possible", "r");
    int first = 0, last = -1;
    if (f) {
        if (fscanf(f, "%d-%d", &first, &last) < 2) last = first;
        fclose(f);
    }
    return last >= first ? last - first + 1 : (int)sysconf(_SC_NPROCESSORS_CONF);
}

static void *serve_ring(void *arg) {
    struct uring_queue *q = arg;
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(q->qid, &one);
    sched_setaffinity(0, sizeof one, &one); /* its requests are this CPU's callers' */
    struct io_uring_params p;
    memset(&p, 0, sizeof p);
    p.flags = IORING_SETUP_SQE128;
    unsigned depth = 2 * q->entries;
    int rfd = syscall(__NR_io_uring_setup, depth, &p);
    if (rfd < 0) {
        perror("io_uring_setup");
        exit(1);
    }
    size_t sq_size = p.sq_off.array + p.sq_entries * sizeof(uint32_t);
    size_t cq_size = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    if (cq_size > sq_size) sq_size = cq_size;
    char *sq = mmap(0, sq_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, rfd, IORING_OFF_SQ_RING);
    char *cq = sq; /* IORING_FEAT_SINGLE_MMAP: every kernel this runs on */
    char *sqes = mmap(0, p.sq_entries * 128, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, rfd, IORING_OFF_SQES);
    if (sq == MAP_FAILED || sqes == MAP_FAILED || !(p.features & IORING_FEAT_SINGLE_MMAP)) {
        fprintf(stderr, "io_uring: cannot map the rings\n");
        exit(1);
    }
    unsigned *sq_tail = (unsigned *)(sq + p.sq_off.tail), *sq_array = (unsigned *)(sq + p.sq_off.array);
    unsigned sq_mask = *(unsigned *)(sq + p.sq_off.ring_mask);
    unsigned *cq_head = (unsigned *)(cq + p.cq_off.head), *cq_tail = (unsigned *)(cq + p.cq_off.tail);
    unsigned cq_mask = *(unsigned *)(cq + p.cq_off.ring_mask);
    struct io_uring_cqe *cqes = (struct io_uring_cqe *)(cq + p.cq_off.cqes);
    struct ring_entry *ents = calloc(q->entries, sizeof *ents);
    unsigned queued = 0, tail = *sq_tail;
    for (int i = 0; i < q->entries; i++) {
        ents[i].payload = aligned_alloc(4096, ring_payload);
        ents[i].iov[0] = (struct iovec){&ents[i].header, sizeof ents[i].header};
        ents[i].iov[1] = (struct iovec){ents[i].payload, ring_payload};
    }
#define PUSH(i, cmd_op_, commit)                                                                          \
    do {                                                                                                  \
        struct io_uring_sqe *sqe = (struct io_uring_sqe *)(sqes + (tail & sq_mask) * 128);             \
        memset(sqe, 0, 128);                                                                              \
        sqe->opcode = IORING_OP_URING_CMD;                                                                \
        sqe->fd = main_fd;                                                                                \
        sqe->cmd_op = (cmd_op_);                                                                          \
        sqe->addr = (uint64_t)(uintptr_t)ents[i].iov;                                                     \
        sqe->len = 2;                                                                                     \
        sqe->user_data = (i);                                                                             \
        struct ring_cmd *c = (struct ring_cmd *)sqe->cmd;                                                 \
        c->commit_id = (commit);                                                                          \
        c->qid = q->qid;                                                                                  \
        sq_array[tail & sq_mask] = tail & sq_mask;                                                        \
        tail++, queued++;                                                                                 \
    } while (0)
    for (int i = 0; i < q->entries; i++) PUSH(i, RING_REGISTER, 0);
    for (;;) {
        __atomic_store_n(sq_tail, tail, __ATOMIC_RELEASE);
        int n = syscall(__NR_io_uring_enter, rfd, queued, 1, IORING_ENTER_GETEVENTS, NULL, 0);
        if (n < 0 && errno != EINTR) {
            perror("io_uring_enter");
            break;
        }
        if (n > 0) queued -= n < (int)queued ? (unsigned)n : queued;
        unsigned head = *cq_head, gone = 0;
        while (head != __atomic_load_n(cq_tail, __ATOMIC_ACQUIRE)) {
            struct io_uring_cqe *cqe = &cqes[head & cq_mask];
            int i = cqe->user_data;
            if (cqe->res < 0) { /* unmounted (ENOTCONN, ECONNABORTED...) or refused: the entry is gone */
                if (cqe->res != -ENOTCONN && cqe->res != -ECONNABORTED && cqe->res != -ENODEV)
                    fprintf(stderr, "io_uring entry of queue %d: %s\n", q->qid, strerror(-cqe->res));
                gone++;
            } else {
                struct ring_entry *ent = &ents[i];
                struct fuse_in_header *in = (struct fuse_in_header *)ent->header.in_out;
                uint64_t unique = in->unique;
                if (in->opcode < OPCODES) q->counts[in->opcode]++;
                const void *reply = NULL;
                size_t len = 0;
                int error = handle(in, ent->header.op_in, ent->payload, ent->header.ent.payload_sz, ent->payload,
                                   ring_payload, &reply, &len);
                if (error > 0) error = 0; /* the ring has no "no answer": nothing the ring carries asks for none */
                if (error < 0) len = 0;
                if (len && reply != ent->payload) memcpy(ent->payload, reply, len);
                struct fuse_out_header *out = (struct fuse_out_header *)ent->header.in_out;
                out->len = sizeof *out + len;
                out->error = error;
                out->unique = unique;
                ent->header.ent.payload_sz = len;
                PUSH(i, RING_COMMIT_AND_FETCH, unique);
            }
            head++;
        }
        __atomic_store_n(cq_head, head, __ATOMIC_RELEASE);
        if (gone) break; /* the mount is going: its legacy worker ends the program */
    }
    return NULL;
}

static const char *opcode_name(int op) {
    static const char *known[OPCODES] = {
        [FUSE_LOOKUP] = "lookup",       [FUSE_FORGET] = "forget",         [FUSE_GETATTR] = "getattr",
        [FUSE_SETATTR] = "setattr",     [FUSE_READLINK] = "readlink",     [FUSE_OPEN] = "open",
        [FUSE_READ] = "read",           [FUSE_STATFS] = "statfs",         [FUSE_RELEASE] = "release",
        [FUSE_GETXATTR] = "getxattr",   [FUSE_LISTXATTR] = "listxattr",   [FUSE_FLUSH] = "flush",
        [FUSE_INIT] = "init",           [FUSE_OPENDIR] = "opendir",       [FUSE_READDIR] = "readdir",
        [FUSE_RELEASEDIR] = "releasedir", [FUSE_ACCESS] = "access",       [FUSE_INTERRUPT] = "interrupt",
        [FUSE_DESTROY] = "destroy",     [FUSE_IOCTL] = "ioctl",           [FUSE_POLL] = "poll",
        [FUSE_BATCH_FORGET] = "batch_forget", [FUSE_READDIRPLUS] = "readdirplus", [FUSE_LSEEK] = "lseek",
        [52] = "statx", /* FUSE_STATX: newer headers than some machines have */
    };
    return known[op];
}

static void write_counts(const char *path) {
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (!f) {
        perror(tmp);
        return;
    }
    fputc('{', f);
    int first = 1;
    for (int op = 0; op < OPCODES; op++) {
        uint64_t total = 0;
        for (int i = 0; i < worker_count; i++) total += __atomic_load_n(&workers[i].counts[op], __ATOMIC_RELAXED);
        for (int i = 0; i < queue_count; i++) total += __atomic_load_n(&queues[i].counts[op], __ATOMIC_RELAXED);
        if (!total) continue;
        if (opcode_name(op))
            fprintf(f, "%s\"%s\": %llu", first ? "" : ", ", opcode_name(op), (unsigned long long)total);
        else
            fprintf(f, "%s\"%d\": %llu", first ? "" : ", ", op, (unsigned long long)total);
        first = 0;
    }
    uint64_t ring = 0; /* of those, the requests the ring carried (MODE 2) */
    for (int i = 0; i < queue_count; i++)
        for (int op = 0; op < OPCODES; op++) ring += __atomic_load_n(&queues[i].counts[op], __ATOMIC_RELAXED);
    if (queue_count) fprintf(f, "%s\"via_ring\": %llu", first ? "" : ", ", (unsigned long long)ring);
    fputs("}\n", f);
    fclose(f);
    rename(tmp, path);
}

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: %s TABLE FD THREADS CLONE COUNTS (started by null_fs.py --fuse c)\n", argv[0]);
        return 2;
    }
    load(argv[1]);
    main_fd = atoi(argv[2]);
    worker_count = atoi(argv[3]);
    int clone = atoi(argv[4]);
    const char *counts = argv[5];
    if (worker_count < 1) worker_count = 1;
    sigset_t caught;
    sigemptyset(&caught);
    sigaddset(&caught, SIGUSR1);
    sigaddset(&caught, SIGTERM);
    sigaddset(&caught, SIGINT);
    pthread_sigmask(SIG_BLOCK, &caught, NULL); /* the workers inherit it: only sigwait below takes them */
    if (clone == 2) { /* the ring: a queue per CPU, `threads` entries each, and one worker on /dev/fuse */
        queue_count = possible_cpus();
        queues = calloc(queue_count, sizeof *queues);
        for (int i = 0; i < queue_count; i++) {
            queues[i].qid = i;
            queues[i].entries = worker_count;
        }
        worker_count = 1;
    }
    workers = calloc(worker_count, sizeof *workers);
    workers_left = worker_count;
    for (int i = 0; i < worker_count; i++) {
        workers[i].fd = main_fd;
        if (clone && i > 0) {
            int fd = open("/dev/fuse", O_RDWR | O_CLOEXEC);
            uint32_t from = main_fd;
            if (fd < 0 || ioctl(fd, FUSE_DEV_IOC_CLONE, &from) != 0) {
                perror("FUSE_DEV_IOC_CLONE");
                return 1;
            }
            workers[i].fd = fd;
        }
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setstacksize(&attr, 1 << 20);
        pthread_create(&workers[i].thread, &attr, serve, &workers[i]);
    }
    for (int i = 0; i < queue_count; i++) pthread_create(&queues[i].thread, NULL, serve_ring, &queues[i]);
    for (;;) {
        int sig;
        if (sigwait(&caught, &sig) != 0) continue;
        if (sig == SIGUSR1) {
            if (*counts) write_counts(counts);
            continue;
        }
        break; /* SIGTERM, SIGINT, or the last worker saw the mount go */
    }
    return 0;
}
