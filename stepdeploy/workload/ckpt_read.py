"""The checkpoint read at memory speed (issue 37 item 2).

megatron-core's torch_dist load reads through torch DCP's FileSystemReader, which handles one stored item after
another: torch.load into a new host tensor, then a copy from that pageable memory into the target -- on the H200
about 1.7 GB/s for a 48 GB checkpoint in /dev/shm. Every stored tensor item is a torch.save archive (an
uncompressed zip) whose data record holds the tensor's bytes as they are. For each item that is a whole stored
chunk of a plain contiguous tensor, read into a contiguous target of the same dtype and shape (the same layout as
saved: every restart of a run), this reader finds that record and reads the bytes straight from the file with
os.preadv, which releases the GIL, from several threads: into the target itself when it is in host memory, else
into a ring of page-locked buffers that a side stream copies to the GPU while the next ones are read. Everything
else (a resharded read, pickled objects, an archive it does not recognise, a transformed item) goes through
torch's own reader, unchanged; a file shorter than its metadata says fails the load, as torch's does.

Standard library + torch + megatron-core only (shipped as a file). STEPDEPLOY_CKPT_FASTREAD=0 (`render --env`):
torch's reader for everything, to compare.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import pickle
import struct
import time
import zipfile
from collections import OrderedDict, deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import torch

PIECE_BYTES = 64 << 20  # one page-locked buffer; a larger tensor is read in pieces
SLOTS = 8  # page-locked buffers in the ring (512 MiB)
THREADS = int(os.environ.get("STEPDEPLOY_CKPT_READ_THREADS", "8"))  # readers at once

# the storage classes torch.save names in its pickle, and their element types
_STORAGES = {"BFloat16Storage": torch.bfloat16, "HalfStorage": torch.float16, "FloatStorage": torch.float32,
             "DoubleStorage": torch.float64, "LongStorage": torch.int64, "IntStorage": torch.int32,
             "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
             "BoolStorage": torch.bool}


@dataclasses.dataclass
class ReadStats:
    """What one load read, and how: the restore's evidence (logged, and in the rank's `resumed` phase)."""

    direct_bytes: int = 0  # read straight from the files
    host_bytes: int = 0  # of it, from the host copy (host_copy.py)
    direct_items: int = 0
    other_tensors: int = 0  # tensor items through torch's reader (resharded, not recognised)
    objects: int = 0  # pickled objects (torch's reader)
    seconds: float = 0.0  # in read_data, both kinds
    locate_s: float = 0.0  # of it, finding the items' bytes in their archives
    copy_s: float = 0.0  # of it, the direct reads and copies

    def summary(self) -> dict[str, float]:
        gbps = self.direct_bytes / self.seconds / 1e9 if self.seconds else 0.0
        return {"direct_gb": round(self.direct_bytes / 1e9, 3), "host_gb": round(self.host_bytes / 1e9, 3),
                "direct_items": self.direct_items,
                "other_tensors": self.other_tensors, "objects": self.objects, "read_gbps": round(gbps, 2),
                "locate_s": round(self.locate_s, 3), "copy_s": round(self.copy_s, 3)}


class Saved(NamedTuple):
    """A torch.save archive's one tensor: where its bytes lie in the file, and what they are."""

    offset: int  # of the first byte, in the file
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def enabled() -> bool:
    return os.environ.get("STEPDEPLOY_CKPT_FASTREAD", "1") != "0"


def locate(fd: int, start: int, length: int) -> Saved | None:
    """The tensor saved by torch.save in bytes [start, start + length) of the open file `fd`, when it is one
    contiguous tensor that is its whole storage, stored uncompressed and little-endian; None for anything else."""
    window = _Window(fd, start, length)
    try:
        with zipfile.ZipFile(window) as archive:
            infos = archive.infolist()
            pickles = [i for i in infos if i.filename.endswith("/data.pkl")]
            records = [i for i in infos if "/data/" in i.filename]
            orders = [i for i in infos if i.filename.endswith("/byteorder")]
            if len(pickles) != 1 or len(records) != 1 or len(orders) > 1:
                return None
            if orders and archive.read(orders[0]) != b"little":
                return None
            record = records[0]
            described = _describe(archive.read(pickles[0]))
        if described is None or record.compress_type != zipfile.ZIP_STORED:
            return None
        key, dtype, shape = described
        if key != record.filename.rsplit("/", 1)[1]:
            return None
        nbytes = _numel(shape) * dtype.itemsize
        if record.file_size != nbytes:  # a view of a larger storage, or not what the pickle says
            return None
        # the record's local header: 30 bytes, then its name and extra field (their lengths at 26 and 28)
        header = os.pread(fd, 30, start + record.header_offset)
        if len(header) != 30 or header[:4] != b"PK\x03\x04":
            return None
        name_length, extra_length = struct.unpack("<HH", header[26:30])
        offset = start + record.header_offset + 30 + name_length + extra_length
        if offset + nbytes > start + length:
            return None
        return Saved(offset, nbytes, dtype, shape)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, pickle.UnpicklingError, EOFError, ValueError, TypeError,
            KeyError, IndexError, struct.error):
        return None


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


class _Window(io.RawIOBase):
    """Bytes [start, start + length) of an open file, as a read-only seekable file (what zipfile reads)."""

    def __init__(self, fd: int, start: int, length: int) -> None:
        super().__init__()
        self.fd, self.start, self.length, self.position = fd, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.length}[whence]
        if base + offset < 0:
            raise ValueError("seek before the start of the item")
        self.position = base + offset
        return self.position

    def readinto(self, buffer: Any) -> int:
        wanted = max(0, min(len(buffer), self.length - self.position))
        data = os.pread(self.fd, wanted, self.start + self.position)
        buffer[:len(data)] = data
        self.position += len(data)
        return len(data)


class _Rebuilt(NamedTuple):
    storage: tuple[str, torch.dtype, int]  # (key, dtype, numel)
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def _rebuild(storage: Any, offset: Any, shape: Any, stride: Any, *_: Any) -> _Rebuilt:
    return _Rebuilt(storage, offset, tuple(shape), tuple(stride))


class _Describer(pickle.Unpickler):
    """Reads torch.save's pickle of one tensor without building it: only the names such a pickle uses load."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if module == "torch" and name in _STORAGES:
            return _STORAGES[name]
        raise pickle.UnpicklingError(f"not a plain tensor: {module}.{name}")

    def persistent_load(self, pid: Any) -> tuple[str, torch.dtype, int]:
        kind, dtype, key, _location, numel = pid
        if kind != "storage" or not isinstance(dtype, torch.dtype):
            raise pickle.UnpicklingError(f"not a storage: {kind}")
        return str(key), dtype, int(numel)


def _describe(data: bytes) -> tuple[str, torch.dtype, tuple[int, ...]] | None:
    """(the data record's key, dtype, shape) of a pickled tensor that is its whole storage, contiguous."""
    rebuilt = _Describer(io.BytesIO(data)).load()
    if not isinstance(rebuilt, _Rebuilt):
        return None
    key, dtype, numel = rebuilt.storage
    shape = rebuilt.shape
    contiguous, step = [], 1
    for size in reversed(shape):
        contiguous.append(step)
        step *= size
    if rebuilt.offset != 0 or numel != _numel(shape):
        return None
    if any(size > 1 and stride != want for size, stride, want in zip(shape, rebuilt.stride,
                                                                     reversed(contiguous), strict=True)):
        return None
    return key, dtype, shape


class _Piece(NamedTuple):
    fd: int
    offset: int
    target: torch.Tensor  # one-dimensional uint8 view of the target's bytes


def _pieces(fd: int, saved: Saved, target: torch.Tensor) -> Iterator[_Piece]:
    flat = target.reshape(-1).view(torch.uint8)
    for at in range(0, saved.nbytes, PIECE_BYTES):
        yield _Piece(fd, saved.offset + at, flat[at:at + PIECE_BYTES])


def _read_exact(fd: int, view: memoryview, offset: int) -> None:
    while view:
        count = os.preadv(fd, [view], offset)
        if count == 0:
            raise EOFError(f"checkpoint file ends at byte {offset}, before the item its metadata names")
        view, offset = view[count:], offset + count


def _host_view(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.numpy()).cast("B")


def copy_pieces(pieces: list[_Piece], threads: int = THREADS) -> None:
    """Read every piece's bytes into its target: host targets directly, GPU targets through page-locked buffers."""
    host = [p for p in pieces if p.target.device.type == "cpu"]
    devices = sorted({p.target.device for p in pieces if p.target.device.type != "cpu"}, key=str)
    with ThreadPoolExecutor(max(1, threads)) as pool:
        for done in [pool.submit(_read_exact, p.fd, _host_view(p.target), p.offset) for p in host]:
            done.result()
        for device in devices:
            _through_pinned([p for p in pieces if p.target.device == device], pool, device)


def _through_pinned(pieces: list[_Piece], pool: ThreadPoolExecutor, device: torch.device) -> None:
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))  # the targets' own fills come first
    slots = [(torch.empty(PIECE_BYTES, dtype=torch.uint8, pin_memory=True), torch.cuda.Event())
             for _ in range(min(SLOTS, len(pieces)))]
    inflight: deque[tuple[Any, _Piece, torch.Tensor, torch.cuda.Event]] = deque()

    def drain() -> None:
        reading, piece, buffer, copied = inflight.popleft()
        reading.result()
        with torch.cuda.stream(stream):
            piece.target.copy_(buffer[:piece.target.numel()], non_blocking=True)
            copied.record(stream)

    for index, piece in enumerate(pieces):
        if len(inflight) == len(slots):
            drain()
        buffer, copied = slots[index % len(slots)]
        copied.synchronize()  # the buffer's previous copy to the GPU has ended (at once if it never had one)
        view = _host_view(buffer[:piece.target.numel()])
        inflight.append((pool.submit(_read_exact, piece.fd, view, piece.offset), piece, buffer, copied))
    while inflight:
        drain()
    stream.synchronize()


def _direct(reader: Any, req: Any, planner: Any, fds: dict[str, int],
            files: contextlib.ExitStack) -> tuple[Saved, torch.Tensor, int] | None:
    """Where one tensor item of `reader`'s plan lies in its file and the tensor it fills, or None where the item is
    not a whole plain tensor the target takes as it is (torch's reader then takes it)."""
    info = reader.storage_data[req.storage_index]
    if getattr(info, "transform_descriptors", None) or any(req.storage_offsets):
        return None
    if info.relative_path not in fds:
        path = reader.host.get(info.relative_path) or reader.fs.concat_path(reader.path, info.relative_path)
        fd = os.open(str(path), os.O_RDONLY)
        files.callback(os.close, fd)
        fds[info.relative_path] = fd
    fd = fds[info.relative_path]
    saved = locate(fd, info.offset, info.length)
    if saved is None or tuple(req.lengths) != saved.shape:
        return None
    target = planner.resolve_tensor(req).detach()
    if target.dtype != saved.dtype or tuple(target.shape) != saved.shape or not target.is_contiguous():
        return None
    return saved, target, fd


def reader_class() -> type:
    """The reader: megatron-core's metadata-caching FileSystemReader with read_data's tensor items read directly."""
    from megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader import (
        CachedMetadataFileSystemReader,
    )
    from torch.distributed.checkpoint.planner import LoadItemType

    class DirectReader(CachedMetadataFileSystemReader):
        def __init__(self, path: Any, stats: ReadStats, host: dict[str, Any] | None = None) -> None:
            """`host`: {file name: its host copy}, files to read there instead (host_copy.usable)."""
            super().__init__(path)
            self.stats, self.host = stats, host or {}

        def read_data(self, plan: Any, planner: Any) -> Any:
            started = time.perf_counter()
            with contextlib.ExitStack() as files:
                fds: dict[str, int] = {}
                pieces, direct, rest = [], [], []
                for req in plan.items:
                    found = _direct(self, req, planner, fds, files) if req.type == LoadItemType.TENSOR else None
                    if found is None:
                        rest.append(req)
                        continue
                    saved, target, fd = found
                    pieces.extend(_pieces(fd, saved, target))
                    direct.append((req, target))
                    self.stats.direct_bytes += saved.nbytes
                    if self.storage_data[req.storage_index].relative_path in self.host:
                        self.stats.host_bytes += saved.nbytes
                located = time.perf_counter()
                copy_pieces(pieces)
                self.stats.locate_s += located - started
                self.stats.copy_s += time.perf_counter() - located
                for req, target in direct:
                    planner.commit_tensor(req, target)
            self.stats.direct_items += len(direct)
            objects = sum(req.type != LoadItemType.TENSOR for req in rest)
            self.stats.objects += objects
            self.stats.other_tensors += len(rest) - objects
            result = super().read_data(dataclasses.replace(plan, items=rest), planner) if rest else None
            self.stats.seconds += time.perf_counter() - started
            if result is None:
                from torch.futures import Future

                result = Future()
                result.set_result(None)
            return result

    return DirectReader


def load_strategy(stats: ReadStats, host: dict[str, Any] | None = None) -> Any:
    """megatron-core's torch_dist load strategy, reading through DirectReader (`host`: files to read from the host
    copy): the strategy builds its reader with a module-level function, which this swaps for the length of one load
    (and puts back, whatever happens)."""
    from megatron.core.dist_checkpointing.strategies import torch as strategies

    reader = reader_class()

    class DirectLoad(strategies.TorchDistLoadShardedStrategy):
        def load(self, *args: Any, **kwargs: Any) -> Any:  # (sharded_state_dict, checkpoint_dir[, 0.19's more])
            original = strategies._get_filesystem_reader
            strategies._get_filesystem_reader = lambda path, *_, **__: reader(path, stats, host)
            try:
                return super().load(*args, **kwargs)
            finally:
                strategies._get_filesystem_reader = original

    return DirectLoad()
