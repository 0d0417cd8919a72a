/*
 * rlmtrain._jail: lock a freshly forked REPL worker into its box.
 *
 * Called once, in the worker, after fork and before any model code runs. The Landlock ruleset
 * (step 5) is built first, while descriptors are not yet limited; then, in order:
 *   1. rlimits (address space, CPU seconds, open files, file size, threads, no core dumps);
 *   2. when running as root, drop to the worker's own unprivileged uid/gid (no supplementary
 *      groups). A uid per worker makes RLIMIT_NPROC a per-worker thread budget and puts every
 *      other process (trainer, zygote, other workers) out of signal and ptrace reach;
 *   3. PR_SET_PDEATHSIG so the worker dies with the zygote that forked it;
 *   4. no_new_privs;
 *   5. Landlock, when the kernel has it: full access beneath the working directory, reads only
 *      beneath the given paths (the Python installation, not the trainer's data: a policy
 *      that can read the answer file will learn to), no exec, no TCP, and (ABI >= 6) no
 *      signals or abstract unix sockets outside the worker;
 *   6. a hand-written seccomp-bpf filter (default allow, explicit refusals). Refusals return
 *      EPERM so Python raises PermissionError and the session lives on; a syscall from a
 *      foreign ABI (wrong audit arch, x32) kills the process, since its numbers mean something
 *      else and nothing legitimate in the worker makes one.
 *
 * An architecture the filter does not know refuses to start: running unjailed is never a
 * fallback. Landlock is the only optional layer (old kernels lack it); `enter` returns the ABI
 * it applied (0 = none) so the caller can say so.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <stddef.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/landlock.h>
#include <linux/sched.h>
#include <linux/seccomp.h>

#if defined(__x86_64__)
#define JAIL_AUDIT_ARCH AUDIT_ARCH_X86_64
#elif defined(__aarch64__)
#define JAIL_AUDIT_ARCH AUDIT_ARCH_AARCH64
#else
#define JAIL_AUDIT_ARCH 0
#endif

#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define ARG_LOW_OFFSET(i) (offsetof(struct seccomp_data, args) + 8 * (i))
#else
#define ARG_LOW_OFFSET(i) (offsetof(struct seccomp_data, args) + 8 * (i) + 4)
#endif

#define RET_ERRNO(e) (SECCOMP_RET_ERRNO | ((e) & SECCOMP_RET_DATA))

/* Syscalls refused outright with EPERM: leaving the box (exec, namespaces, mounts, other
 * processes' memory or signals), talking to the network, loading code into the kernel,
 * changing machine-wide state, or holding memory outside the worker's limits: SysV and POSIX
 * IPC objects live in the host's IPC namespace, outlive the worker and are readable by a later
 * one (a channel between rollouts), and neither they nor memfd files count against
 * RLIMIT_AS. */
static const int refused_syscalls[] = {
    SYS_execve, SYS_execveat,
    SYS_shmget, SYS_shmat, SYS_shmdt, SYS_shmctl, SYS_msgget, SYS_msgsnd, SYS_msgrcv, SYS_msgctl,
    SYS_semget, SYS_semop, SYS_semctl,
#ifdef SYS_semtimedop
    SYS_semtimedop,
#endif
    SYS_mq_open, SYS_mq_unlink, SYS_mq_timedsend, SYS_mq_timedreceive, SYS_mq_notify,
    SYS_mq_getsetattr, SYS_memfd_create,
#ifdef SYS_memfd_secret
    SYS_memfd_secret,
#endif
#ifdef SYS_fork
    SYS_fork,
#endif
#ifdef SYS_vfork
    SYS_vfork,
#endif
    SYS_ptrace, SYS_process_vm_readv, SYS_process_vm_writev, SYS_kcmp,
#ifdef SYS_process_madvise
    SYS_process_madvise,
#endif
    SYS_move_pages, SYS_migrate_pages,
    SYS_socket, SYS_connect, SYS_bind, SYS_listen, SYS_accept, SYS_accept4,
    SYS_mount, SYS_umount2, SYS_pivot_root, SYS_chroot, SYS_unshare, SYS_setns,
#ifdef SYS_open_tree
    SYS_open_tree, SYS_move_mount, SYS_fsopen, SYS_fsconfig, SYS_fsmount, SYS_fspick,
#endif
#ifdef SYS_mount_setattr
    SYS_mount_setattr,
#endif
    SYS_bpf, SYS_perf_event_open, SYS_userfaultfd,
#ifdef SYS_io_uring_setup
    SYS_io_uring_setup, SYS_io_uring_enter, SYS_io_uring_register,
#endif
    SYS_keyctl, SYS_add_key, SYS_request_key,
    SYS_reboot, SYS_swapon, SYS_swapoff, SYS_kexec_load,
#ifdef SYS_kexec_file_load
    SYS_kexec_file_load,
#endif
    SYS_init_module, SYS_finit_module, SYS_delete_module,
    SYS_personality, SYS_acct, SYS_quotactl, SYS_syslog, SYS_vhangup,
    SYS_settimeofday, SYS_clock_settime, SYS_adjtimex, SYS_clock_adjtime,
    SYS_sethostname, SYS_setdomainname,
    SYS_name_to_handle_at, SYS_open_by_handle_at, SYS_fanotify_init,
#ifdef SYS_pidfd_send_signal
    SYS_pidfd_send_signal,
#endif
#ifdef SYS_pidfd_getfd
    SYS_pidfd_getfd,
#endif
    SYS_rt_sigqueueinfo, SYS_rt_tgsigqueueinfo, SYS_tkill,
    SYS_seccomp, SYS_setsid, SYS_setpgid,
    SYS_setuid, SYS_setgid, SYS_setreuid, SYS_setregid, SYS_setresuid, SYS_setresgid,
    SYS_setfsuid, SYS_setfsgid, SYS_setgroups, SYS_capset,
#ifdef SYS_iopl
    SYS_iopl, SYS_ioperm,
#endif
#ifdef SYS_modify_ldt
    SYS_modify_ldt,
#endif
#ifdef SYS_uselib
    SYS_uselib,
#endif
};

/* prctl options that would loosen the box: a new seccomp mode, surviving the zygote, letting
 * another process ptrace us, adopting orphans, rewriting the mm or the security bits. */
static const unsigned int refused_prctls[] = {
    PR_SET_SECCOMP, PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_PTRACER, PR_SET_CHILD_SUBREAPER,
    PR_SET_MM, PR_SET_SECUREBITS, PR_CAP_AMBIENT,
};

#define NAMESPACE_CLONE_FLAGS                                                                    \
    (CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | \
     CLONE_NEWNET)

#define MAX_FILTER 512

typedef struct {
    struct sock_filter insns[MAX_FILTER];
    unsigned short len;
} Filter;

static void emit(Filter *f, struct sock_filter insn) {
    if (f->len < MAX_FILTER) f->insns[f->len] = insn;
    f->len++;
}

static void emit_stmt(Filter *f, unsigned short code, unsigned int k) { emit(f, (struct sock_filter)BPF_STMT(code, k)); }

static void emit_jump(Filter *f, unsigned short code, unsigned int k, unsigned char jt, unsigned char jf) {
    emit(f, (struct sock_filter)BPF_JUMP(code, k, jt, jf));
}

/* Emits "if nr == syscall: <body of body_len instructions>"; the body must end in a return so
 * that the accumulator still holds nr for whatever follows. */
static void emit_syscall_guard(Filter *f, int nr, unsigned char body_len) {
    emit_jump(f, BPF_JMP | BPF_JEQ | BPF_K, (unsigned int)nr, 0, body_len);
}

static void emit_load_arg_low(Filter *f, int i) { emit_stmt(f, BPF_LD | BPF_W | BPF_ABS, ARG_LOW_OFFSET(i)); }

static int build_filter(Filter *f, pid_t self) {
    unsigned int self_u = (unsigned int)self;
    unsigned int group_u = (unsigned int)(-self);
    size_t i;

    f->len = 0;
    emit_stmt(f, BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch));
    emit_jump(f, BPF_JMP | BPF_JEQ | BPF_K, JAIL_AUDIT_ARCH, 1, 0);
    emit_stmt(f, BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS);
    emit_stmt(f, BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr));
#if defined(__x86_64__)
    /* x32 syscalls share the audit arch but carry bit 30; refuse the whole ABI. */
    emit_jump(f, BPF_JMP | BPF_JGE | BPF_K, 0x40000000u, 0, 1);
    emit_stmt(f, BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS);
#endif

    for (i = 0; i < sizeof(refused_syscalls) / sizeof(refused_syscalls[0]); i++) {
        emit_syscall_guard(f, refused_syscalls[i], 1);
        emit_stmt(f, BPF_RET | BPF_K, RET_ERRNO(EPERM));
    }

    /* clone: threads only (CLONE_THREAD implies a shared mm), never a new namespace. The kernel
     * reads only the low 32 bits of the flags. */
    emit_syscall_guard(f, SYS_clone, 5);
    emit_load_arg_low(f, 0);
    emit_jump(f, BPF_JMP | BPF_JSET | BPF_K, NAMESPACE_CLONE_FLAGS, 2, 0);
    emit_jump(f, BPF_JMP | BPF_JSET | BPF_K, CLONE_THREAD, 0, 1);
    emit_stmt(f, BPF_RET | BPF_K, SECCOMP_RET_ALLOW);
    emit_stmt(f, BPF_RET | BPF_K, RET_ERRNO(EPERM));

#ifdef SYS_clone3
    /* clone3 passes its flags in memory, out of the filter's sight. ENOSYS makes glibc fall back
     * to clone, which the rule above can inspect. */
    emit_syscall_guard(f, SYS_clone3, 1);
    emit_stmt(f, BPF_RET | BPF_K, RET_ERRNO(ENOSYS));
#endif

    /* socketpair: only connected AF_UNIX stream pairs (a datagram socket could sendto() any
     * named socket on the host). socket() itself is refused above. */
    emit_syscall_guard(f, SYS_socketpair, 7);
    emit_load_arg_low(f, 0);
    emit_jump(f, BPF_JMP | BPF_JEQ | BPF_K, AF_UNIX, 0, 3);
    emit_load_arg_low(f, 1);
    emit_stmt(f, BPF_ALU | BPF_AND | BPF_K, 0xf);
    emit_jump(f, BPF_JMP | BPF_JEQ | BPF_K, SOCK_STREAM, 1, 0);
    emit_stmt(f, BPF_RET | BPF_K, RET_ERRNO(EPERM));
    emit_stmt(f, BPF_RET | BPF_K, SECCOMP_RET_ALLOW);

    /* kill: only ourselves, by pid, as pid 0 (our own process group, which holds only us) or as
     * -pid (the same group named explicitly). */
    emit_syscall_guard(f, SYS_kill, 6);
    emit_load_arg_low(f, 0);
    emit_jump(f, BPF_JMP | BPF_JEQ | BPF_K, 0, 2, 0);
    emit_jump(f, BPF_JMP | BPF_JEQ | BPF_K, self_u, 1, 0);
    emit_jump(f, BPF_JMP | BPF_JEQ | BPF_K, group_u, 0, 1);
    emit_stmt(f, BPF_RET | BPF_K, SECCOMP_RET_ALLOW);
    emit_stmt(f, BPF_RET | BPF_K, RET_ERRNO(EPERM));

    /* tgkill: threads of our own process (raise(), pthread_kill). */
    emit_syscall_guard(f, SYS_tgkill, 4);
    emit_load_arg_low(f, 0);
    emit_jump(f, BPF_JMP | BPF_JEQ | BPF_K, self_u, 0, 1);
    emit_stmt(f, BPF_RET | BPF_K, SECCOMP_RET_ALLOW);
    emit_stmt(f, BPF_RET | BPF_K, RET_ERRNO(EPERM));

    /* ioctl: no injecting input into a terminal. */
    emit_syscall_guard(f, SYS_ioctl, 4);
    emit_load_arg_low(f, 1);
    emit_jump(f, BPF_JMP | BPF_JEQ | BPF_K, TIOCSTI, 1, 0);
    emit_stmt(f, BPF_RET | BPF_K, SECCOMP_RET_ALLOW);
    emit_stmt(f, BPF_RET | BPF_K, RET_ERRNO(EPERM));

    {
        unsigned char n = (unsigned char)(sizeof(refused_prctls) / sizeof(refused_prctls[0]));
        emit_syscall_guard(f, SYS_prctl, (unsigned char)(n + 3));
        emit_load_arg_low(f, 0);
        for (i = 0; i < n; i++) emit_jump(f, BPF_JMP | BPF_JEQ | BPF_K, refused_prctls[i], (unsigned char)(n - i), 0);
        emit_stmt(f, BPF_RET | BPF_K, SECCOMP_RET_ALLOW);
        emit_stmt(f, BPF_RET | BPF_K, RET_ERRNO(EPERM));
    }

    emit_stmt(f, BPF_RET | BPF_K, SECCOMP_RET_ALLOW);
    return f->len <= MAX_FILTER ? 0 : -1;
}

/* ---- Landlock ---------------------------------------------------------------------------- */

/* The kernel ABI, spelled out here because distribution headers lag the kernels they run on
 * (this file must use ABI 6 scoping on a new kernel even when built against ABI 2 headers).
 * The kernel accepts any prefix of the attribute struct; the size passed says which fields. */
struct ruleset_attr {
    __u64 handled_access_fs;
    __u64 handled_access_net; /* ABI 4 */
    __u64 scoped;             /* ABI 6 */
};
#define LL_FS_TRUNCATE (1ULL << 14)      /* ABI 3 */
#define LL_FS_IOCTL_DEV (1ULL << 15)     /* ABI 5 */
#define LL_NET_BIND_TCP (1ULL << 0)      /* ABI 4 */
#define LL_NET_CONNECT_TCP (1ULL << 1)   /* ABI 4 */
#define LL_SCOPE_ABSTRACT_UNIX (1ULL << 0) /* ABI 6 */
#define LL_SCOPE_SIGNAL (1ULL << 1)      /* ABI 6 */

static int landlock_abi(void) {
    long abi = syscall(SYS_landlock_create_ruleset, NULL, 0, LANDLOCK_CREATE_RULESET_VERSION);
    return abi < 0 ? 0 : (int)abi;
}

/* Filesystem rights Landlock handles at a given ABI: everything, reads included. */
static __u64 handled_fs_rights(int abi) {
    __u64 rights = LANDLOCK_ACCESS_FS_EXECUTE | LANDLOCK_ACCESS_FS_WRITE_FILE | LANDLOCK_ACCESS_FS_READ_FILE |
                   LANDLOCK_ACCESS_FS_READ_DIR | LANDLOCK_ACCESS_FS_REMOVE_DIR | LANDLOCK_ACCESS_FS_REMOVE_FILE |
                   LANDLOCK_ACCESS_FS_MAKE_CHAR | LANDLOCK_ACCESS_FS_MAKE_DIR | LANDLOCK_ACCESS_FS_MAKE_REG |
                   LANDLOCK_ACCESS_FS_MAKE_SOCK | LANDLOCK_ACCESS_FS_MAKE_FIFO | LANDLOCK_ACCESS_FS_MAKE_BLOCK |
                   LANDLOCK_ACCESS_FS_MAKE_SYM;
    if (abi >= 2) rights |= LANDLOCK_ACCESS_FS_REFER;
    if (abi >= 3) rights |= LL_FS_TRUNCATE;
    if (abi >= 5) rights |= LL_FS_IOCTL_DEV;
    return rights;
}

static int add_rule(int ruleset, int fd, __u64 rights) {
    struct landlock_path_beneath_attr rule;
    memset(&rule, 0, sizeof(rule));
    rule.allowed_access = rights;
    rule.parent_fd = fd;
    return (int)syscall(SYS_landlock_add_rule, ruleset, LANDLOCK_RULE_PATH_BENEATH, &rule, 0);
}

/* Builds the ruleset: everything beneath workdir_fd; reading only beneath read_fds (files or
 * directories); nothing elsewhere. The descriptors are O_PATH, opened while still privileged.
 * Returns the ruleset fd (*abi set), -1 on error (errno set), or -2 when the kernel has no
 * Landlock. Built before the rlimits, which may leave no room for new descriptors. */
static int build_landlock_ruleset(int workdir_fd, const int *read_fds, int n_read, int *abi) {
    struct ruleset_attr attr;
    size_t attr_size = offsetof(struct ruleset_attr, handled_access_net);
    struct stat st;
    int ruleset, err, i;

    *abi = landlock_abi();
    if (*abi < 1) return -2;
    memset(&attr, 0, sizeof(attr));
    attr.handled_access_fs = handled_fs_rights(*abi);
    if (*abi >= 4) {
        /* Handled with no rule: every TCP bind and connect is refused. */
        attr.handled_access_net = LL_NET_BIND_TCP | LL_NET_CONNECT_TCP;
        attr_size = offsetof(struct ruleset_attr, scoped);
    }
    if (*abi >= 6) {
        attr.scoped = LL_SCOPE_ABSTRACT_UNIX | LL_SCOPE_SIGNAL;
        attr_size = sizeof(attr);
    }
    ruleset = (int)syscall(SYS_landlock_create_ruleset, &attr, attr_size, 0);
    if (ruleset < 0) return -1;

    if (add_rule(ruleset, workdir_fd, attr.handled_access_fs & ~(__u64)LANDLOCK_ACCESS_FS_EXECUTE) < 0) goto fail;
    for (i = 0; i < n_read; i++) {
        /* A rule on a file may only carry file rights. */
        if (fstat(read_fds[i], &st) < 0) goto fail;
        __u64 rights = LANDLOCK_ACCESS_FS_READ_FILE | (S_ISDIR(st.st_mode) ? LANDLOCK_ACCESS_FS_READ_DIR : 0);
        if (add_rule(ruleset, read_fds[i], rights) < 0) goto fail;
    }
    return ruleset;
fail:
    err = errno;
    close(ruleset);
    errno = err;
    return -1;
}

/* ---- Python API -------------------------------------------------------------------------- */

static PyObject *raise_step(const char *step) {
    int err = errno;
    PyObject *msg = PyUnicode_FromFormat("jail: %s failed: %s", step, strerror(err));
    if (msg) {
        PyObject *args = Py_BuildValue("(iO)", err, msg);
        if (args) {
            PyErr_SetObject(PyExc_OSError, args);
            Py_DECREF(args);
        }
        Py_DECREF(msg);
    }
    return NULL;
}

static int set_limit(int resource, rlim_t soft, rlim_t hard) {
    struct rlimit rl = {soft, hard};
    return setrlimit(resource, &rl);
}

/* Steps 2-5 of the module comment; ruleset < 0 means no Landlock. Returns NULL on success,
 * else the step that failed. */
static const char *drop_and_confine(uid_t uid, gid_t gid, pid_t parent_pid, int ruleset) {
    if (geteuid() == 0) {
        if (setgroups(0, NULL)) return "setgroups";
        if (setresgid(gid, gid, gid)) return "setresgid";
        if (setresuid(uid, uid, uid)) return "setresuid";
        if (geteuid() == 0 || getuid() == 0 || getegid() == 0) {
            errno = EPERM;
            return "dropping root";
        }
    }
    /* Set after the uid change, which would clear it. */
    if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0)) return "PR_SET_PDEATHSIG";
    if (getppid() != parent_pid) {
        errno = ESRCH;
        return "parent check (the zygote is gone)";
    }
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)) return "PR_SET_NO_NEW_PRIVS";
    if (ruleset >= 0 && syscall(SYS_landlock_restrict_self, ruleset, 0) < 0) return "landlock";
    return NULL;
}

#define MAX_READABLE 256

/* Opens each existing path of `readable` as O_PATH; paths that do not exist are skipped.
 * Returns the number opened, or -1 with a Python exception set. */
static int open_readable(PyObject *readable, int *fds) {
    PyObject *seq = PySequence_Fast(readable, "jail: readable must be a sequence of paths");
    Py_ssize_t i, n;
    int count = 0;
    if (seq == NULL) return -1;
    n = PySequence_Fast_GET_SIZE(seq);
    if (n > MAX_READABLE) {
        PyErr_Format(PyExc_ValueError, "jail: at most %d readable paths, got %zd", MAX_READABLE, n);
        goto fail;
    }
    for (i = 0; i < n; i++) {
        PyObject *encoded = NULL;
        int fd;
        if (!PyUnicode_FSConverter(PySequence_Fast_GET_ITEM(seq, i), &encoded)) goto fail;
        fd = open(PyBytes_AS_STRING(encoded), O_PATH | O_CLOEXEC);
        if (fd < 0 && errno != ENOENT && errno != ENOTDIR) {
            PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, encoded);
            Py_DECREF(encoded);
            goto fail;
        }
        Py_DECREF(encoded);
        if (fd >= 0) fds[count++] = fd;
    }
    Py_DECREF(seq);
    return count;
fail:
    while (count > 0) close(fds[--count]);
    Py_DECREF(seq);
    return -1;
}

PyDoc_STRVAR(enter_doc,
             "enter(uid, gid, parent_pid, address_space, cpu_seconds, open_files, file_size, threads, readable) -> int\n\n"
             "Jail the calling process, which must be single-threaded and already in its working\n"
             "directory: rlimits, drop to uid/gid when root, die with parent_pid, no_new_privs,\n"
             "Landlock (full access beneath the working directory, read-only beneath the paths in\n"
             "`readable`, nothing elsewhere), seccomp. Irreversible. Returns the Landlock ABI\n"
             "applied (0 = the kernel has none). Raises OSError naming the step that failed and\n"
             "RuntimeError on an architecture the filter does not know.");

static PyObject *jail_enter(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"uid",       "gid",     "parent_pid", "address_space", "cpu_seconds", "open_files",
                             "file_size", "threads", "readable",   NULL};
    unsigned int uid, gid;
    int parent_pid;
    unsigned long long address_space, cpu_seconds, open_files, file_size, threads;
    PyObject *readable;
    Filter filter;
    struct sock_fprog prog;
    int abi, ruleset, workdir_fd, err, n_read;
    int read_fds[MAX_READABLE];
    const char *failed_step;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "IIiKKKKKO", kwlist, &uid, &gid, &parent_pid, &address_space,
                                     &cpu_seconds, &open_files, &file_size, &threads, &readable))
        return NULL;
    if (JAIL_AUDIT_ARCH == 0) {
        PyErr_SetString(PyExc_RuntimeError, "jail: no seccomp filter for this CPU architecture; refusing to run unjailed");
        return NULL;
    }
    if (uid == 0 || gid == 0) {
        PyErr_SetString(PyExc_ValueError, "jail: uid and gid must be unprivileged (non-zero)");
        return NULL;
    }
    if (build_filter(&filter, getpid()) != 0) {
        PyErr_SetString(PyExc_RuntimeError, "jail: seccomp filter does not fit its buffer");
        return NULL;
    }
    n_read = open_readable(readable, read_fds);
    if (n_read < 0) return NULL;
    workdir_fd = open(".", O_PATH | O_CLOEXEC | O_DIRECTORY);
    if (workdir_fd < 0) {
        err = errno;
        while (n_read > 0) close(read_fds[--n_read]);
        errno = err;
        return raise_step("opening the working directory");
    }
    ruleset = build_landlock_ruleset(workdir_fd, read_fds, n_read, &abi);
    err = errno;
    close(workdir_fd);
    while (n_read > 0) close(read_fds[--n_read]);
    errno = err;
    if (ruleset == -1) return raise_step("building the landlock ruleset");

    /* Soft CPU limit sends SIGXCPU (fatal by default), the hard one a second later SIGKILL. */
    failed_step = NULL;
    if (set_limit(RLIMIT_AS, address_space, address_space)) failed_step = "RLIMIT_AS";
    else if (set_limit(RLIMIT_CPU, cpu_seconds, cpu_seconds + 1)) failed_step = "RLIMIT_CPU";
    else if (set_limit(RLIMIT_NOFILE, open_files, open_files)) failed_step = "RLIMIT_NOFILE";
    else if (set_limit(RLIMIT_FSIZE, file_size, file_size)) failed_step = "RLIMIT_FSIZE";
    else if (set_limit(RLIMIT_NPROC, threads, threads)) failed_step = "RLIMIT_NPROC";
    else if (set_limit(RLIMIT_CORE, 0, 0)) failed_step = "RLIMIT_CORE";
    else if (set_limit(RLIMIT_MEMLOCK, 0, 0)) failed_step = "RLIMIT_MEMLOCK";
    else if (set_limit(RLIMIT_MSGQUEUE, 0, 0)) failed_step = "RLIMIT_MSGQUEUE";
    else failed_step = drop_and_confine(uid, gid, parent_pid, ruleset);
    err = errno;
    if (ruleset >= 0) close(ruleset);
    errno = err;
    if (failed_step) return raise_step(failed_step);

    prog.len = filter.len;
    prog.filter = filter.insns;
    if (syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &prog)) return raise_step("seccomp");
    return PyLong_FromLong(ruleset >= 0 ? abi : 0);
}

PyDoc_STRVAR(set_parent_death_signal_doc,
             "set_parent_death_signal(signum, parent_pid) -> None\n\n"
             "Have the kernel send signum to this process when its parent dies; raises OSError if\n"
             "the parent is already gone (getppid() != parent_pid).");

static PyObject *jail_set_parent_death_signal(PyObject *self, PyObject *args) {
    int signum, parent_pid;
    if (!PyArg_ParseTuple(args, "ii", &signum, &parent_pid)) return NULL;
    if (prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0)) return raise_step("PR_SET_PDEATHSIG");
    if (getppid() != parent_pid) {
        errno = ESRCH;
        return raise_step("parent check");
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(landlock_abi_doc, "landlock_abi() -> int\n\nThe kernel's Landlock ABI version, 0 if it has none.");

static PyObject *jail_landlock_abi(PyObject *self, PyObject *unused) { return PyLong_FromLong(landlock_abi()); }

static PyMethodDef jail_methods[] = {
    {"enter", (PyCFunction)(void (*)(void))jail_enter, METH_VARARGS | METH_KEYWORDS, enter_doc},
    {"set_parent_death_signal", jail_set_parent_death_signal, METH_VARARGS, set_parent_death_signal_doc},
    {"landlock_abi", jail_landlock_abi, METH_NOARGS, landlock_abi_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef jail_module = {
    PyModuleDef_HEAD_INIT, "_jail",
    "Process jail for REPL workers: rlimits, uid drop, no_new_privs, Landlock, seccomp-bpf.", -1, jail_methods,
};

PyMODINIT_FUNC PyInit__jail(void) {
    PyObject *m = PyModule_Create(&jail_module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "SUPPORTED_ARCH", JAIL_AUDIT_ARCH != 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
