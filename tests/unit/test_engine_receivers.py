"""Engine-owned receivers of the transport contract (forgerl.interfaces.EngineReceiver):
shm stages each version alone in a folder an engine loads; nccl gives an engine instance a
group of its own with the sender and broadcasts each bucket while the engine receives it.
The engine side here is a thread that joins the group as SGLang's
``init_custom_process_group`` does (rendezvous + PrefixStore + torch's group helper), on
gloo."""

from __future__ import annotations

import io
import threading
from datetime import timedelta

import pytest
import torch

from forgerl.errors import TransportError, TransportTimeout
from forgerl.interfaces import BroadcastEngineReceiver, FilesEngineReceiver
from forgerl.types import WeightSet
from tests.helpers.listeners import own_listeners
from tests.helpers.timing import scaled


def _weights(version: int) -> WeightSet:
    g = torch.Generator().manual_seed(version)
    return WeightSet(
        version,
        {
            "model.embed.weight": torch.randn(8, 4, generator=g).to(torch.bfloat16),
            "model.norm.weight": torch.randn(4, generator=g),
            "lm_head.weight": torch.randn(8, 4, generator=g),
        },
    )


def test_shm_stages_a_version_alone_in_a_folder_and_releases_it(tmp_path):
    from safetensors.torch import load_file

    from forgerl_plugins.transports.shm.transport import ShmTransport

    transport = ShmTransport(ShmTransport.Options(directory=str(tmp_path / "w")), context=None)
    assert transport.engine_receivers == ("files",)
    sender = transport.sender()
    receiver = transport.engine_receiver("sglang-0", "files")
    assert isinstance(receiver, FilesEngineReceiver)
    try:
        sender.send(_weights(1))
        sender.send(_weights(2))  # two versions in the transport's directory
        folder = receiver.stage(2, timeout=scaled(10))
        assert [p.name for p in folder.iterdir()] == ["model.safetensors"]
        got = load_file(str(folder / "model.safetensors"))
        for name, t in _weights(2).items():
            assert torch.equal(got[name], t), name
        receiver.release(2)
        assert not folder.exists()
        with pytest.raises(TransportTimeout):
            receiver.stage(9, timeout=0.3)
        with pytest.raises(TransportError, match="cannot feed"):
            transport.engine_receiver("x", "broadcast")
    finally:
        receiver.close()
        sender.close()
        transport.close()
    assert not (tmp_path / "w").exists() or not any((tmp_path / "w").glob("engine-*"))


def _engine_side(conn) -> None:
    """SGLang's side (another process, as an engine is), as its init_custom_process_group
    and update_weights_from_distributed do: join, then receive each bucket it is told of."""
    from torch.distributed import BroadcastOptions
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, rendezvous

    group, seconds = conn.recv()
    wait = timedelta(seconds=seconds)
    url = f"tcp://{group['master_address']}:{group['master_port']}"
    store, rank, world = next(rendezvous(url, group["rank_offset"], group["world_size"], timeout=wait))
    store.set_timeout(wait)
    made = _new_process_group_helper(
        world, rank, [], Backend(group["backend"]), PrefixStore(group["group_name"], store),
        group_name=group["group_name"], timeout=wait,
    )  # fmt: skip
    pg = made[0] if isinstance(made, tuple) else made
    got = {}
    while (bucket := conn.recv()) is not None:
        for name, dtype, shape in bucket:
            t = torch.empty(shape, dtype=getattr(torch, dtype))
            opts = BroadcastOptions()
            opts.rootRank = 0
            pg.broadcast([t], opts).wait()
            got[name] = t
        conn.send("ok")
    buffer = io.BytesIO()
    torch.save(got, buffer)  # bytes: torch's shared-memory handles die with this process
    conn.send(buffer.getvalue())


def test_nccl_broadcasts_each_bucket_to_an_engines_own_group():
    from forgerl_plugins.transports.nccl.transport import NcclTransport

    transport = NcclTransport(NcclTransport.Options(backend="gloo", bucket_mb=1), context=None)
    assert transport.engine_receivers == ("broadcast",)
    sender = transport.sender()
    receiver = transport.engine_receiver("sglang-0", "broadcast", ranks=1)
    assert isinstance(receiver, BroadcastEngineReceiver)
    receiver.bucket_bytes = 100  # type: ignore[attr-defined]  # several buckets of the tiny weights
    group = receiver.group()
    assert group["world_size"] == 2 and group["rank_offset"] == 1 and group["backend"] == "gloo"
    import multiprocessing

    here, there = multiprocessing.get_context("spawn").Pipe()
    engine = multiprocessing.get_context("spawn").Process(target=_engine_side, args=(there,), daemon=True)
    engine.start()
    try:
        here.send((group, scaled(60)))
        receiver.connect(timeout=scaled(60))
        # The group's store (hosted here as rank 0, unsigned: the engine's side is SGLang's
        # code) listens on the run's interface only, not on every interface as torch's
        # rendezvous would have it listen.
        on_port = {a for a, p in own_listeners() if p == group["master_port"]}
        assert on_port == {"127.0.0.1"}, f"the engine group's store listens on {sorted(on_port)}"
        weights = _weights(1)
        errors: list = []

        def send() -> None:
            try:
                sender.send(weights, timeout=scaled(30))
            except Exception as exc:  # noqa: BLE001 - checked below
                errors.append(exc)

        sending = threading.Thread(target=send)
        sending.start()
        seen: list[str] = []
        sizes = []
        for bucket in receiver.receive(1, timeout=scaled(30)):
            seen += [s.name for s in bucket]
            sizes.append(len(bucket))
            # The engine is told to receive exactly these, while they are broadcast.
            here.send([(s.name, s.dtype, s.shape) for s in bucket])
            assert here.poll(scaled(30)) and here.recv() == "ok"
        sending.join(scaled(30))
        assert not sending.is_alive() and not errors, errors
        assert seen == [name for name, _ in weights.items()] and sizes == [2, 1]
        here.send(None)
        assert here.poll(scaled(30))
        got = torch.load(io.BytesIO(here.recv()))
        for name, t in weights.items():
            assert torch.equal(got[name], t), name
        assert receiver.latest_version() == 1
    finally:
        engine.join(scaled(10))
        if engine.is_alive():
            engine.kill()
        receiver.close()
        sender.close()
        transport.close()


def test_a_send_names_the_engine_that_did_not_take_the_version():
    from forgerl_plugins.transports.nccl.transport import NcclTransport

    transport = NcclTransport(NcclTransport.Options(backend="gloo"), context=None)
    sender = transport.sender()
    receiver = transport.engine_receiver("sglang-7", "broadcast")
    try:
        with pytest.raises(TransportTimeout, match="sglang-7"):
            sender.send(_weights(1), timeout=0.5)
        with pytest.raises(TransportError, match="not connected"):
            receiver.receive(1, timeout=0.1)
    finally:
        receiver.close()
        sender.close()
        transport.close()
