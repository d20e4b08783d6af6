"""Network interface counters (the node_exporter `netdev` analogue).

Per interface (the entries of `<sys_root>/class/net`): bytes, packets, errors and drops in both
directions, and link speed from `<sys_root>/class/net/<if>/speed` (Mb/s) when it reads as a
positive number (virtual devices give -1 or EINVAL).

The counters are the kernel's `dev_get_stats()`, which both `/proc/net/dev` and sysfs
`statistics/*` print: one read of `<proc_root>/net/dev` gives every interface's bytes, packets,
errors and transmit drops at once, where sysfs costs a file per counter. Its receive `drop`
column, though, adds `rx_missed_errors` to `rx_dropped`, and the catalogue's receive drop
counter is sysfs `rx_dropped` ("received packets dropped"), so that one (and `speed`) comes
from sysfs: both files of up to `MAX_OPEN_INTERFACES` interfaces stay open and each run
`pread`s them from offset 0 (sysfs regenerates an attribute on every read from the start),
with the interface's entry in `class/net` checked by inode (the entry itself, `lstat`: the
class symlink moves with a renamed device and is made anew for a new one, and resolving it
costs a path walk) so that an interface renamed, or removed and created again under the same
name, is reopened rather than read through stale descriptors.
An interface missing from `/proc/net/dev` (or no `/proc/net/dev`), or every interface when the
two list different interfaces (another network namespace's sysfs), is read from its sysfs
`statistics/*` files; one without a statistics directory, or no sysfs at all, from
`/proc/net/dev` alone (its receive drops then include missed packets).

`/proc/net/dev` stays open too, and the listing of `class/net` is kept while the two list the
same interfaces: it is taken again when `/proc/net/dev` lists other interfaces (or the same
in another order: a rename), when an interface of it is gone from sysfs, and at least every
`RELIST_NS` (an interface only sysfs shows is found within that long). Each interface's
counters go through `Emitter.counter_row` (one call for its eight).
"""

from __future__ import annotations

import logging
import operator
import os

from agent.clock import now_ns
from collectors.base import (
    BaseCollector,
    Collection,
    CounterTracker,
    Emitter,
    NameFilter,
    read_int,
)

log = logging.getLogger(__name__)

#: (sysfs statistics file, /proc/net/dev column, catalogued counter).
NIC_COUNTERS: tuple[tuple[str, int, str], ...] = (
    ("rx_bytes", 0, "kvscope_nic_receive_bytes_total"),
    ("rx_packets", 1, "kvscope_nic_receive_packets_total"),
    ("rx_errors", 2, "kvscope_nic_receive_errors_total"),
    ("rx_dropped", 3, "kvscope_nic_receive_drop_total"),
    ("tx_bytes", 8, "kvscope_nic_transmit_bytes_total"),
    ("tx_packets", 9, "kvscope_nic_transmit_packets_total"),
    ("tx_errors", 10, "kvscope_nic_transmit_errors_total"),
    ("tx_dropped", 11, "kvscope_nic_transmit_drop_total"),
)
_SYSFS_FILES = tuple(f for f, _, _ in NIC_COUNTERS)
_RX_DROPPED = _SYSFS_FILES.index("rx_dropped")  # the one counter read from sysfs
_MBIT_TO_BYTES = 125_000  # 1 Mb/s = 10**6 bits/s = 125,000 bytes/s
#: Interfaces whose rx_dropped and speed files stay open (2 descriptors each); more are read by
#: path each run.
MAX_OPEN_INTERFACES = 256


class _OpenNic:
    """The open `statistics/rx_dropped` and `speed` (or -1) files of one interface."""

    __slots__ = ("drop", "ino", "path", "speed")

    def __init__(self, path: str, ino: int, drop: int, speed: int) -> None:
        self.path = path  # the interface's entry in class/net
        self.ino = ino
        self.drop = drop
        self.speed = speed

    def read(self) -> tuple[int, int | None]:
        return int(os.pread(self.drop, 64, 0)), _pread_speed(self.speed)

    def close(self) -> None:
        for fd in (self.drop, self.speed):
            if fd >= 0:
                os.close(fd)
        self.drop = self.speed = -1


def parse_proc_net_dev(text: str) -> dict[str, list[int]]:
    """`/proc/net/dev` → interface → its 16 counters (8 receive, then 8 transmit)."""
    out: dict[str, list[int]] = {}
    for line in text.splitlines()[2:]:
        name, sep, rest = line.partition(":")
        if not sep:
            continue
        values = rest.split()
        if len(values) < 16:
            continue
        out[name.strip()] = [int(v) for v in values[:16]]
    return out


_COLS = tuple(col for _, col, _ in NIC_COUNTERS)
_PICK = operator.itemgetter(*_COLS)
#: The catalogued counters of one interface, in `NIC_COUNTERS` order.
_ROW = tuple(metric for _, _, metric in NIC_COUNTERS)


def _net_dev_rows(data: bytes) -> dict[str, list[int]]:
    """`/proc/net/dev` → interface → its catalogued counters in `NIC_COUNTERS` order (what
    `parse_proc_net_dev` gives, the eight columns picked), in the file's order."""
    out: dict[str, list[int]] = {}
    pick = _PICK
    for line in data.split(b"\n")[2:]:
        name, sep, rest = line.partition(b":")
        if not sep:
            continue
        v = rest.split()
        if len(v) < 16:
            continue
        out[name.strip().decode()] = list(map(int, pick(v)))
    return out


#: With sysfs and /proc/net/dev listing the same interfaces, the sysfs listing is taken again
#: when /proc/net/dev lists others (or the same in another order: a rename) and at least
#: this often (an interface only sysfs shows is found within this long).
RELIST_NS = 60 * 1_000_000_000


class NicCollector(BaseCollector):
    """Reads interface counters.

    Args:
        sys_root: where sysfs is mounted (a fixture tree in tests).
        proc_root: where procfs is mounted.
        include: glob patterns of interfaces to keep (none = all).
        exclude: glob patterns of interfaces to drop (wins over include).
        clock: monotonic ns clock.
    """

    name = "nic"
    source = "nic"

    def __init__(self, *, sys_root: str = "/sys", proc_root: str = "/proc",
                 include: tuple[str, ...] = (), exclude: tuple[str, ...] = (),
                 clock=now_ns) -> None:
        super().__init__()
        self.net_dir = os.path.join(sys_root, "class", "net")
        self.proc_net_dev = os.path.join(proc_root, "net", "dev")
        self.filter = NameFilter(tuple(include), tuple(exclude))
        self.clock = clock
        self.counters = CounterTracker()
        self._seen: set[str] = set()
        self._open: dict[str, _OpenNic] = {}
        self._proc_fd = -1  # /proc/net/dev, kept open and re-read from offset 0
        # The last sysfs listing, filtered, while it listed what /proc/net/dev did: (the
        # interfaces /proc/net/dev listed then, in its order, the names kept, when).
        self._listed: tuple[tuple[str, ...], list[str], int] | None = None

    def collect(self) -> Collection:
        ts = self.clock()
        em = Emitter(self.source, ts, self.counters, self.keep_samples)
        proc_error: OSError | None = None
        try:
            proc: dict[str, list[int]] | None = _net_dev_rows(self._read_proc())
        except OSError as exc:
            proc, proc_error = None, exc
        read = self._read_listed(proc, ts)
        if read is None:  # no listing kept, or an interface of it left sysfs: list again
            read = self._read_all(proc, proc_error, ts)
        present: set[str] = set()
        for dev, values, speed in read:
            present.add(dev)
            labels = (dev,)
            em.counter_row(_ROW, labels, values, dev)
            if speed is not None:
                em.gauge("kvscope_nic_speed_bytes", labels, speed * _MBIT_TO_BYTES, dev)
        for dev in sorted(self._seen - present):
            em.event("interface_vanished", {"device": dev})
        for dev in [d for d in self._open if d not in present]:
            self._open.pop(dev).close()
        self._seen = present
        self.counters.end_cycle()
        return em.out

    def _read_listed(self, proc: dict[str, list[int]] | None, ts: int
                     ) -> list[tuple[str, list[int], int | None]] | None:
        """The interfaces of the kept sysfs listing, while /proc/net/dev lists what it did
        then (in the same order) and the listing is younger than `RELIST_NS`; None when it
        may be stale (or an interface of it is gone from sysfs)."""
        listed = self._listed
        if (listed is None or proc is None or ts - listed[2] >= RELIST_NS
                or listed[0] != tuple(proc)):
            return None
        out = []
        for dev in listed[1]:
            row = proc[dev]
            extra = self._read_open(dev)
            if extra is None:
                return None  # its statistics directory is gone (or never was): list again
            values = row[:]
            values[_RX_DROPPED] = extra[0]
            out.append((dev, values, extra[1]))
        return out

    def _read_all(self, proc: dict[str, list[int]] | None, proc_error: OSError | None,
                  ts: int) -> list[tuple[str, list[int], int | None]]:
        """Every interface, the sysfs directory listed (and the listing kept while it lists
        what /proc/net/dev does)."""
        self._listed = None
        try:
            listing = os.listdir(self.net_dir)
            sysfs = True
        except FileNotFoundError:
            sysfs = False
        if proc is None:
            if not sysfs and proc_error is not None:
                raise proc_error  # neither source is readable
            proc = {}  # statistics files only
        if not sysfs:
            return [(dev, proc[dev], None) for dev in self.filter.filter(proc)]
        names = self.filter.filter(listing)
        # /proc/net/dev is this process's network namespace, sysfs the one it was mounted in
        # (a container with the host's /sys): the two list other interfaces then, and a
        # same-named one may be another device. Counters come from /proc/net/dev only while
        # both list the same interfaces; else from each interface's own statistics files.
        fast = set(proc) == set(listing)
        out = []
        kept = fast
        for dev in names:
            row = proc.get(dev)
            extra = self._read_open(dev) if row is not None and fast else None
            if row is not None and extra is not None:
                values = row[:]
                values[_RX_DROPPED] = extra[0]
                out.append((dev, values, extra[1]))
                continue
            kept = False  # read by path: the next run lists again
            sysfs_values = self._read_sysfs_paths(dev)
            if sysfs_values is None:
                if not os.path.isdir(os.path.join(self.net_dir, dev)):
                    continue  # vanished between listdir and read
                if row is None:
                    continue
                sysfs_values = row  # no statistics directory: /proc/net/dev alone
            out.append((dev, sysfs_values, self._speed(dev)))
        if kept:
            self._listed = (tuple(proc), names, ts)
        return out

    def _read_proc(self) -> bytes:
        """/proc/net/dev to its end (procfs hands it out a page or so per read) through a
        descriptor kept open; reopened once if reading it fails."""
        if self._proc_fd >= 0:
            try:
                return _pread_all(self._proc_fd)
            except OSError:
                os.close(self._proc_fd)
                self._proc_fd = -1
        fd = os.open(self.proc_net_dev, os.O_RDONLY)
        try:
            data = _pread_all(fd)
        except BaseException:
            os.close(fd)
            raise
        self._proc_fd = fd
        return data

    def close(self) -> None:
        for nic in self._open.values():
            nic.close()
        self._open.clear()
        if self._proc_fd >= 0:
            os.close(self._proc_fd)
            self._proc_fd = -1
        self._listed = None

    def _read_open(self, dev: str) -> tuple[int, int | None] | None:
        """(sysfs rx_dropped, speed in Mb/s or None) of `dev` through its kept-open files;
        None when it has no statistics directory."""
        nic = self._open.get(dev)
        if nic is not None:
            try:
                if os.lstat(nic.path).st_ino == nic.ino:
                    return nic.read()
            except OSError:
                pass  # removed (ENODEV through the old descriptors) or gone from the listing
            del self._open[dev]
            nic.close()
        path = os.path.join(self.net_dir, dev)
        if len(self._open) >= MAX_OPEN_INTERFACES:
            try:
                return read_int(os.path.join(path, "statistics", "rx_dropped")), self._speed(dev)
            except (FileNotFoundError, NotADirectoryError):
                return None
        try:
            ino = os.lstat(path).st_ino
            drop = os.open(os.path.join(path, "statistics", "rx_dropped"), os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            speed = os.open(os.path.join(path, "speed"), os.O_RDONLY)
        except OSError:
            speed = -1
        nic = self._open[dev] = _OpenNic(path, ino, drop, speed)
        return nic.read()

    def _read_sysfs_paths(self, dev: str) -> list[int] | None:
        # Opening the files relative to the statistics directory resolves the class symlink
        # once per interface instead of once per counter (a third of the cost).
        try:
            dfd = os.open(os.path.join(self.net_dir, dev, "statistics"),
                          os.O_RDONLY | os.O_DIRECTORY)
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            out = []
            for f in _SYSFS_FILES:
                fd = os.open(f, os.O_RDONLY, dir_fd=dfd)
                try:
                    out.append(int(os.read(fd, 64)))
                finally:
                    os.close(fd)
            return out
        except FileNotFoundError:
            return None
        finally:
            os.close(dfd)

    def _speed(self, dev: str) -> int | None:
        try:
            mbit = read_int(os.path.join(self.net_dir, dev, "speed"))
        except (OSError, ValueError):
            return None  # EINVAL on virtual or down devices
        return mbit if mbit > 0 else None


def _pread_all(fd: int) -> bytes:
    chunks = []
    off = 0
    while chunk := os.pread(fd, 65536, off):
        chunks.append(chunk)
        off += len(chunk)
    return b"".join(chunks)


def _pread_speed(fd: int) -> int | None:
    if fd < 0:
        return None
    try:
        mbit = int(os.pread(fd, 64, 0))
    except (OSError, ValueError):
        return None  # EINVAL on virtual or down devices
    return mbit if mbit > 0 else None
