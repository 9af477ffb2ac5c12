"""The ``remote`` kind: device servers on other machines (``smartinf serve``), with this host's memory tiers beside."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_smartinf.core.arguments import Problems
from lightning_smartinf.core.registry import BuildContext, DeviceKind, register
from lightning_smartinf.core.state_formats import FORMATS
from lightning_smartinf.devices.remote.policy import is_loopback
from lightning_smartinf.devices.remote.tokens import TlsFiles, read_tls_dir, read_token

if TYPE_CHECKING:
    from contextlib import ExitStack

    from torch import Tensor

    from lightning_smartinf.core.backend import Backend
    from lightning_smartinf.core.format.reshard import Fetch
    from lightning_smartinf.core.settings import SmartUpdateSettings


class RemoteKind(DeviceKind):
    """Device servers: every rank opens a session on each; their state lives on the servers' disks, in sessions that
    last while the rank holds them, and cannot move between a server and this host."""

    name = "remote"
    arguments = ("remote_devices", "remote_token_file", "remote_tls_dir", "remote_allow_plaintext")
    takes_hand_offs = True
    devices_compute = True
    state_held_by_process = True
    state_in_storage_paths = False
    state_movable = False
    keeps_checkpoint_state = True
    state_formats = FORMATS
    weighs = "remote server"

    def check(self, problems: Problems, options: Mapping[str, Any], storage_paths: Sequence[Path] | None) -> Any:
        devices = options.get("remote_devices")
        token_file, tls_dir = options.get("remote_token_file"), options.get("remote_tls_dir")
        known = len(problems)
        if importlib.util.find_spec("grpc") is None:
            problems.add("`backend='remote'` needs gRPC, which is not installed: `pip install -e '.[remote]'`.")
        if isinstance(devices, str) or not isinstance(devices, (list, tuple)) or not devices:
            problems.add(
                f"`remote_devices={devices!r}`: `backend='remote'` needs a list of device servers as 'host:port', "
                "e.g. `remote_devices=['storage1:50051']`."
            )
        else:
            for address in devices:
                host, _, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
                if not host or not port.isdigit() or not 0 < int(port) < 65536:
                    problems.add(f"`remote_devices` entry {address!r} is not 'host:port' (e.g. 'storage1:50051').")
            if repeated := sorted({a for a in devices if isinstance(a, str) and devices.count(a) > 1}):
                problems.add(
                    f"`remote_devices` names {', '.join(map(repr, repeated))} more than once: each entry is one device "
                    "server, which would hold two shares of the state. Name each server once."
                )
        if not isinstance(token_file, (str, os.PathLike)):
            problems.add(
                f"`remote_token_file={token_file!r}`: `backend='remote'` needs the path of a file (mode 0600) holding "
                "the servers' token."
            )
        else:
            token_file = Path(token_file).expanduser()
            try:
                read_token(token_file)
            except ValueError as exc:
                problems.add(f"`remote_token_file`: {exc}")
        if tls_dir is not None:
            try:
                tls_dir = Path(tls_dir).expanduser()
                read_tls_dir(tls_dir)
            except (TypeError, ValueError) as exc:
                problems.add(f"`remote_tls_dir={options.get('remote_tls_dir')!r}`: {exc}")
        plaintext = options.get("remote_allow_plaintext") or False
        problems.flag("remote_allow_plaintext", plaintext)
        if tls_dir is None and not plaintext and len(problems) == known:
            for address in devices:
                if not is_loopback(address):
                    problems.add(
                        f"`remote_devices` entry {address!r} is not on this machine and `remote_tls_dir` is not set: "
                        "the token and the optimizer state would cross the network in clear. Give the servers TLS "
                        "(`smartinf serve --tls-cert/--tls-key`) and this run `remote_tls_dir`, or pass "
                        "`remote_allow_plaintext=True` on a network you trust."
                    )
        if len(problems) > known:
            return {}
        return {
            "remote_devices": tuple(devices),
            "remote_token_file": token_file,
            "remote_tls_dir": tls_dir,
            "remote_allow_plaintext": plaintext,
        }

    def weight_count(self, options: Any, storage_paths: Sequence[Path] | None) -> int | None:
        devices = (options or {}).get("remote_devices")
        return len(devices) if isinstance(devices, (list, tuple)) else None

    def build(self, settings: SmartUpdateSettings, context: BuildContext) -> Backend:
        from lightning_smartinf.core.placement import RoundRobin, TieredPlacement
        from lightning_smartinf.devices.remote.client import RemoteBackend

        addresses, token, tls, plaintext = _access(settings.option)
        weights = settings.device_weights  # every rank opens a session on every server
        return RemoteBackend(
            addresses,
            token,
            label=context.label,
            chunk_elems=settings.chunk_size,
            buffer_count=settings.buffer_count,
            io_threads=settings.io_threads,
            tentative_slots=settings.overlap,
            prefetch_state=settings.prefetch_state,
            device_timeout_s=settings.device_timeout_s,
            placement=RoundRobin() if weights is None else TieredPlacement(tuple(weights), 0, settings.chunk_size),
            tls=tls,
            allow_plaintext=plaintext,
        )

    def checkpoint_masters(
        self, options: Mapping[str, Any], *, timeout: float | None
    ) -> Callable[[Path], list[Tensor]] | None:
        from lightning_smartinf.core.tiers.tiered import masters_with_tiers
        from lightning_smartinf.devices.remote.client import checkpoint_masters

        addresses, token, tls, plaintext = _access(options.get)
        return masters_with_tiers(
            checkpoint_masters(addresses, token, tls=tls, timeout=timeout, allow_plaintext=plaintext)
        )

    def fetch_saved_state(
        self,
        options: Mapping[str, Any],
        rank_dirs: Sequence[Path],
        into: Path,
        scratch: ExitStack,
        *,
        timeout: float | None,
    ) -> tuple[list[Path], Fetch] | None:
        from lightning_smartinf.devices.remote.client import fetch_saved_state, greeted

        addresses, token, tls, plaintext = _access(options.get)
        # Greeted, not opened: no session, so nothing of theirs changes; connected until `scratch` closes.
        return fetch_saved_state(greeted(addresses, token, timeout, tls, plaintext, scratch), rank_dirs, into)


def _access(option: Callable[[str], Any]) -> tuple[tuple[str, ...], str, TlsFiles | None, bool]:
    """From the options ``option`` looks up by name: the servers, the token, the TLS files (``None``: none) and
    whether plain gRPC to another machine is allowed."""
    tls_dir = option("remote_tls_dir")
    tls = None if tls_dir is None else read_tls_dir(tls_dir)
    plaintext = bool(option("remote_allow_plaintext"))
    return option("remote_devices"), read_token(option("remote_token_file")), tls, plaintext


register(RemoteKind())
