"""Reading a DCP checkpoint without running code: DCP's `.metadata` pickle through an exact
allow-list of (module, name) pairs, non-tensor values with `torch.load(weights_only=True)` (torch's
own allow-list), and every refusal as one line (UserError), also from inside `dcp.load`.
Every path that reads a checkpoint (resume auto, resume by path, export, generate) goes through
here before torch's own reader touches the file. docs/checkpoints.md, "Safe reading".
"""
from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._nested_dict import unflatten_state_dict  # noqa: F401
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from shardtune.errors import UserError
from shardtune.train.durable.ckpt_files import DCP_METADATA_GLOBALS, DTYPE_NAMES, refused_global


class _AllowListUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata only: the exact (module, name) pairs of ckpt_files.DCP_METADATA_GLOBALS
    and torch dtypes by name, nothing else.

    Every global a pickle names (GLOBAL in protocols 0-3, STACK_GLOBAL in 4-5, INST, OBJ, the
    extension registry) goes through `find_class`, so a name not in the list is refused before
    anything is imported or called. No dotted names (protocol 4 resolves them through module
    attributes: `torch._strobelight...subprocess.Popen` from a DCP module), no prefixes, no tensor
    rebuilders (DCP metadata holds sizes, never tensors), no persistent ids (no storages)."""

    def find_class(self, module: str, name: str):
        if (module, name) in DCP_METADATA_GLOBALS:
            return super().find_class(module, name)
        # from torch's own dict: getattr could import a lazy submodule
        if module == "torch" and name in DTYPE_NAMES and isinstance(vars(torch).get(name), torch.dtype):
            return vars(torch)[name]
        raise refused_global(module, name)


def read_dcp_metadata(path: Path):
    """A DCP `.metadata` file through the allow-list: a Metadata object, or one line (UserError)."""
    try:
        with open(path, "rb") as f:
            metadata = _AllowListUnpickler(f).load()
    except UserError:
        raise
    except Exception as e:  # truncated, garbage, an unregistered extension code, a persistent id
        raise UserError(f"{path} is not a readable DCP metadata file ({type(e).__name__}: "
                        f"{' '.join(str(e).split())[:120]}); was the checkpoint damaged or tampered with?") from None
    if not isinstance(metadata, Metadata):
        raise UserError(f"{path} holds a {type(metadata).__name__}, not DCP metadata; refusing to load it "
                        "(was the checkpoint tampered with?)")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose `.metadata` pickle is read through an allow-list (caches it)."""

    _cached = None

    def read_metadata(self, *args: Any, **kwargs: Any):
        if self._cached is None:
            path = Path(self.path) / ".metadata"
            if not path.is_file():
                raise UserError(f"{Path(self.path)} is not a DCP checkpoint (no .metadata); give a "
                                "checkpoints/step_<N> folder")
            metadata = read_dcp_metadata(path)

            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            self._cached = metadata
        return self._cached


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that loads non-tensor values with `torch.load(weights_only=True)`."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as e:  # torch's weights_only allow-list refused a global, or the bytes are garbage
            raise UserError(f"checkpoint value {read_item.dest_index.fqn!r} is not plain data ({type(e).__name__}); "
                            "refusing to load it (was the checkpoint tampered with?)") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def safe_dcp_load(sd: dict, reader: SafeFileSystemReader, **kw) -> None:
    """`dcp.load` with the safe planner; a UserError inside it (a refused pickle on some rank) comes
    out as itself, not inside DCP's CheckpointException with a traceback per rank."""
    try:
        dcp.load(sd, storage_reader=reader, planner=SafeLoadPlanner(), **kw)
    except CheckpointException as e:
        users = [exc for exc, _ in e.failures.values() if isinstance(exc, UserError)]
        if users:
            raise users[0] from None
        if kw.get("no_dist"):
            raise _unreadable(reader, next(iter(e.failures.values()))[0]) from None
        raise
    except UserError:
        raise
    except Exception as e:  # one process (export, generate): nothing but the files can be at fault
        if not kw.get("no_dist"):
            raise
        raise _unreadable(reader, e) from None


def _unreadable(reader: SafeFileSystemReader, e: BaseException) -> UserError:
    """Files whose checksums match (or were rewritten with them) but whose bytes DCP cannot read."""
    text = " ".join(str(e).split())[:120]
    why = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return UserError(f"checkpoint {Path(reader.path)} cannot be read ({why}); was it written by shardtune train "
                     "and left as it was? Use another checkpoint")
