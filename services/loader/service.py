"""Loader bus handlers: import a GGUF into the model store, once per content and runtime."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from pathlib import Path

import openvino as ov
from nats.aio.msg import Msg
from prometheus_client import Histogram

from services.loader.settings import LoaderSettings
from services.loader.convert import is_materialized
from services.loader.store import artifact_dir, artifact_id, read_artifact, sha256_of
from shared import subjects
from shared.bus import Bus, decode
from shared.messages import ErrorCode, ImportModel, ModelImported, Rejected

log = logging.getLogger(__name__)

IMPORT_SECONDS = Histogram(
    "tessera_loader_import_seconds",
    "Seconds to import a GGUF into the model store",
    ["converted"],
    buckets=(0.1, 0.5, 1, 2, 5, 10, 20, 40, 80, 160),
)


class ImportRefused(Exception):
    pass


class LoaderService:
    def __init__(self, settings: LoaderSettings, bus: Bus) -> None:
        self.settings = settings
        self.bus = bus
        self.store = settings.model_store.resolve()
        self._locks: dict[str, asyncio.Lock] = {}

    async def start(self) -> None:
        self.store.mkdir(parents=True, exist_ok=True)
        await self.bus.subscribe(subjects.import_model(), self.on_import, queue=subjects.LOADER_QUEUE)

    def _check_source(self, source: str) -> Path:
        path = Path(source).expanduser()
        if not path.is_absolute():
            raise ImportRefused(f"source must be an absolute path to a .gguf file, got {source!r}")
        path = path.resolve()
        allowed = [d.resolve() for d in self.settings.allowed_model_dirs]
        if allowed and not any(path.is_relative_to(d) for d in allowed):
            raise ImportRefused(f"source {source!r} is outside the allowed model directories")
        if path.suffix.lower() != ".gguf" or not path.is_file():
            raise ImportRefused(f"source {source!r} is not a readable .gguf file")
        with path.open("rb") as f:
            if f.read(4) != b"GGUF":
                raise ImportRefused(f"source {source!r} is not a GGUF file (bad magic)")
        return path

    async def import_model(self, source: str) -> ModelImported:
        t0 = time.perf_counter()
        path = self._check_source(source)
        sha = await asyncio.to_thread(sha256_of, path)
        aid = artifact_id(sha, ov.get_version())
        dest = artifact_dir(self.store, aid)
        async with self._locks.setdefault(aid, asyncio.Lock()):
            existing = read_artifact(dest)
            if existing is not None and is_materialized(existing, self.settings.device):
                IMPORT_SECONDS.labels("false").observe(time.perf_counter() - t0)
                return ModelImported(artifact=existing, converted=False, seconds=time.perf_counter() - t0)
            log.info("importing %s into %s", path, dest)
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "services.loader.convert", str(path), str(dest), sha, aid,
                self.settings.device, str(self.settings.inference_threads),
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
            )
            try:
                _, err = await asyncio.wait_for(proc.communicate(), self.settings.import_timeout_s)
            except TimeoutError:
                proc.kill()
                await proc.wait()
                raise ImportRefused(f"conversion of {source!r} timed out") from None
            artifact = read_artifact(dest)
            if proc.returncode != 0 or artifact is None or not is_materialized(artifact, self.settings.device):
                tail = err.decode(errors="replace").strip().splitlines()[-1:] or [""]
                raise ImportRefused(f"conversion of {source!r} failed: {tail[0]}")
        seconds = time.perf_counter() - t0
        IMPORT_SECONDS.labels("true").observe(seconds)
        log.info("imported %s as %s in %.1fs", path, aid, seconds)
        return ModelImported(artifact=artifact, converted=True, seconds=seconds)

    async def on_import(self, msg: Msg) -> None:
        req = decode(msg.data, ImportModel)
        try:
            reply: ModelImported | Rejected = await self.import_model(req.source)
        except ImportRefused as e:
            reply = Rejected(code=ErrorCode.IMPORT_FAILED, message=str(e))
        await self.bus.reply(msg, reply)
