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
 * (FUSE_DEV_IOC_CLONE), CLONE=0 has them share FD.  COUNTS ("" for none): at each SIGUSR1 the requests
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
        uint64_t id = in->nodeid, unique = in->unique;
        if (in->opcode < OPCODES) w->counts[in->opcode]++;
        int op = in->opcode;
        int on_node = op == FUSE_LOOKUP || op == FUSE_GETATTR || op == FUSE_READ || op == FUSE_READDIR ||
                      op == FUSE_READDIRPLUS;
        if (on_node && (id == 0 || id > node_count)) { /* never sent: every id was given by an answer here */
            answer(fd, unique, -ENOENT, NULL, 0);
            continue;
        }
        switch (op) {
        case FUSE_IOCTL: /* isatty() of every CPython < 3.14 open() */
            answer(fd, unique, -ENOTTY, NULL, 0);
            break;
        case FUSE_LOOKUP: {
            size_t len = strnlen(body, body_len);
            uint64_t child = find(id, body, len);
            struct fuse_entry_out e;
            if (child) {
                entry_of(&e, child);
            } else {
                memset(&e, 0, sizeof e);
                e.entry_valid = VALID; /* "no such name", remembered a day */
            }
            answer(fd, unique, 0, &(struct iovec){&e, sizeof e}, 1);
            break;
        }
        case FUSE_GETATTR: {
            struct fuse_attr_out a = {.attr_valid = VALID, .attr = nodes[id - 1].attr};
            answer(fd, unique, 0, &(struct iovec){&a, sizeof a}, 1);
            break;
        }
        case FUSE_READ: {
            struct fuse_read_in *r = (struct fuse_read_in *)body;
            uint64_t size = nodes[id - 1].attr.size, end = r->offset + r->size;
            if (end > size) end = size;
            size_t len = end > r->offset ? end - r->offset : 0;
            if (len > MAX_READ) len = MAX_READ;
            answer(fd, unique, 0, &(struct iovec){(void *)zeros, len}, 1);
            break;
        }
        case FUSE_READDIRPLUS:
        case FUSE_READDIR: {
            struct fuse_read_in *r = (struct fuse_read_in *)body;
            uint32_t size = r->size < BUFFER_BYTES ? r->size : BUFFER_BYTES;
            size_t used = listing(list, id, r->offset, size, op == FUSE_READDIRPLUS);
            answer(fd, unique, 0, &(struct iovec){list, used}, 1);
            break;
        }
        case FUSE_STATFS: {
            struct fuse_statfs_out s = {.st = {.blocks = 1, .files = node_count, .bsize = 4096, .namelen = 255,
                                               .frsize = 4096}};
            answer(fd, unique, 0, &(struct iovec){&s, sizeof s}, 1);
            break;
        }
        case FUSE_FORGET:
        case FUSE_BATCH_FORGET:
            break;
        default: /* OPEN, OPENDIR, INTERRUPT, GETXATTR, ...: as null_fs.py, not implemented */
            answer(fd, unique, -ENOSYS, NULL, 0);
        }
    }
    if (__atomic_sub_fetch(&workers_left, 1, __ATOMIC_SEQ_CST) == 0) kill(getpid(), SIGTERM);
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
        if (!total) continue;
        if (opcode_name(op))
            fprintf(f, "%s\"%s\": %llu", first ? "" : ", ", opcode_name(op), (unsigned long long)total);
        else
            fprintf(f, "%s\"%d\": %llu", first ? "" : ", ", op, (unsigned long long)total);
        first = 0;
    }
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
