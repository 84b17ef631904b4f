"""Tensor parallelism on real ranks: one process per rank on gloo, each running the whole
engine (its own scheduler and policy) over its share of the model; rank 0 takes the
requests and shares them round by round, the others follow. Greedy outputs equal one
rank's, token for token, in float32."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import socket
from pathlib import Path
from typing import Any

import pytest

from asyncinfer.api import LLM
from asyncinfer.distributed.parallel import TensorParallel
from asyncinfer.errors import ConfigError
from asyncinfer.params import SamplingParams
from asyncinfer.processes import has_exited

OPTIONS: dict[str, Any] = {"dtype": "float32", "page_size": 4, "max_running_requests": 8,
                           "num_pages": 512, "max_seq_len": 256, "max_extend_tokens": 48,
                           "tp_guard_interval": 1}


def workload(seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(1, 90))] for _ in range(14)]
    params = [SamplingParams(max_tokens=rng.randrange(1, 20), temperature=0.0,
                             ignore_eos=True) for _ in prompts]
    return prompts, params


def _rank(rank: int, world: int, port: int, model: str, options: dict[str, Any],
          out: str, rank_options: dict[int, dict[str, Any]] | None = None) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    options = {**options, **(rank_options or {}).get(rank, {})}
    online = options.pop("online", False)
    try:
        if rank > 0:  # a follower: rank 0's requests, round by round
            import asyncio

            from asyncinfer.api import AsyncEngine

            follower = AsyncEngine(model, skip_tokenizer_init=True,
                                   tensor_parallel_size=world, **options)
            try:
                asyncio.run(follower.follow())
            except Exception as exc:
                Path(out, f"rank{rank}.json").write_text(json.dumps({"error": str(exc)}))
                # As a launched rank ends (launch._rank_main): tearing the group down while
                # a peer is leaving it too can abort inside gloo, so do not wait on it.
                os._exit(1)
            runner = follower.runner
            Path(out, f"rank{rank}.json").write_text(json.dumps({"held": {
                "heads": runner.shard_config.num_heads,
                "kv_heads": runner.shard_config.num_kv_heads,
                "vocab_rows": runner.model.embed_tokens.num_embeddings,
                "kv_pool_heads": runner.pool.k.shape[-2]}}))
            return
        if online:
            Path(out, "rank0.json").write_text(json.dumps(_online(model, world, options)))
            return
        llm = LLM(model, skip_tokenizer_init=True, tensor_parallel_size=world, **options)
        prompts, params = workload()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        if any(o.error for o in outputs):
            Path(out, f"rank{rank}.json").write_text(json.dumps(
                {"errors": [o.error for o in outputs], "alive": llm.engine.alive}))
            llm.close()
            return
        held = {"heads": llm.runner.shard_config.num_heads,
                "kv_heads": llm.runner.shard_config.num_kv_heads,
                "vocab_rows": llm.runner.model.embed_tokens.num_embeddings,
                "kv_pool_heads": llm.runner.pool.k.shape[-2]}
        Path(out, f"rank{rank}.json").write_text(json.dumps(
            {"tokens": [o.token_ids for o in outputs], "held": held}))
        llm.close()
    finally:
        dist.destroy_process_group()


def _online(model: str, world: int, options: dict[str, Any]) -> dict[str, Any]:
    """Rank 0 as a server's engine: requests arriving over time, a third of them cancelled
    mid-run; the tokens of the others, and what the engine holds at the end."""
    import asyncio

    from asyncinfer.api import AsyncEngine

    async def run() -> dict[str, Any]:
        prompts, params = workload(seed=1)
        async with AsyncEngine(model, skip_tokenizer_init=True, tensor_parallel_size=world,
                               **options) as engine:
            async def one(i: int) -> list[int] | None:
                await asyncio.sleep(0.02 * i)
                task = asyncio.ensure_future(engine.generate(prompts[i], params[i].replace(
                    max_tokens=60 if i % 3 == 0 else params[i].max_tokens)))
                if i % 3 == 0:
                    await asyncio.sleep(0.05)
                    task.cancel()
                    return None
                return (await task).token_ids

            tokens = await asyncio.gather(*(one(i) for i in range(len(prompts))))
            await engine.wait_idle()
            stats = engine.stats()
            return {"tokens": tokens, "held": [stats.running, stats.waiting,
                                               stats.kv_pages_used]}

    return asyncio.run(run())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(world: int, model: Path, options: dict[str, Any], tmp: Path,
              rank_options: dict[int, dict[str, Any]] | None = None,
              exitcodes: list[int] | None = None) -> list[Any]:
    """Every rank's report of the workload: its greedy outputs (rank 0), what it holds."""
    spawn = multiprocessing.get_context("spawn")
    port = _free_port()
    procs = [spawn.Process(target=_rank, args=(r, world, port, str(model), options, str(tmp),
                                               rank_options))
             for r in range(world)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    assert [p.exitcode for p in procs] == (exitcodes or [0] * world)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.parametrize(("model", "policy"), [
    ("tiny_llama_dir", "prefill_first"), ("tiny_llama_dir", "decode_first"),
    ("tiny_llama_dir", "skip_ahead"), ("tiny_llama_dir", "stall_free"),
    ("tiny_qwen3_dir", "prefill_first")])
def test_two_ranks_give_one_ranks_greedy_tokens(model: str, policy: str, tmp_path: Path,
                                                request: pytest.FixtureRequest) -> None:
    """Untied (llama) and tied (qwen3) vocabularies, chunked prefill (48-token rounds),
    every built-in policy: each rank schedules for itself and all agree with one rank."""
    model_dir = request.getfixturevalue(model)
    options = {**OPTIONS, "policy": policy}
    prompts, params = workload()
    llm = LLM(str(model_dir), skip_tokenizer_init=True, **options)
    alone = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.close()
    ranks = run_ranks(2, model_dir, options, tmp_path)
    assert ranks[0]["tokens"] == alone
    full = llm.runner.shard_config
    # Each rank really holds half: heads, KV heads (and its KV pool), vocabulary rows.
    assert ranks[0]["held"] == ranks[1]["held"] == {
        "heads": full.num_heads // 2, "kv_heads": full.num_kv_heads // 2,
        "vocab_rows": full.vocab_size // 2, "kv_pool_heads": full.num_kv_heads // 2}


def test_a_split_that_does_not_divide_the_heads_is_refused() -> None:
    with pytest.raises(ConfigError, match="does not divide the model's attention heads"):
        TensorParallel(0, 3).check(8, 2, 256)
    with pytest.raises(ConfigError, match="KV heads"):
        TensorParallel(0, 4).check(8, 2, 256)


def test_a_split_that_does_not_fit_is_refused_before_any_rank_starts(tiny_llama_dir: Path
                                                                      ) -> None:
    with pytest.raises(ConfigError, match="does not divide the model's attention heads"):
        LLM(str(tiny_llama_dir), skip_tokenizer_init=True, tensor_parallel_size=3, **OPTIONS)
    assert not multiprocessing.active_children()


def ranks_of(llm: LLM) -> list[int]:
    ranks = llm.engine._ranks
    assert ranks is not None
    return [p.pid for p in ranks.processes]


def test_llm_starts_and_stops_its_own_ranks(tiny_llama_dir: Path) -> None:
    """Without a process group, LLM(tensor_parallel_size=2) starts rank 1 itself: greedy
    tokens equal one rank's, with a third of the requests aborted by a stop string... and
    close() leaves no process and no process group."""
    import torch.distributed as dist

    prompts, params = workload(seed=2)
    llm = LLM(str(tiny_llama_dir), skip_tokenizer_init=True, **OPTIONS)
    alone = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.close()
    llm = LLM(str(tiny_llama_dir), skip_tokenizer_init=True, tensor_parallel_size=2,
              **OPTIONS)
    pids = ranks_of(llm)
    assert llm.engine._ranks is not None
    processes = llm.engine._ranks.processes
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == alone
    assert [o.token_ids for o in llm.generate(prompts[:3], params[:3], use_tqdm=False)
            ] == alone[:3]
    llm.close()
    assert not dist.is_initialized()
    assert not multiprocessing.active_children()
    assert all(has_exited(pid) for pid in pids)
    assert [p.exitcode for p in processes] == [0]  # it left the group cleanly, once


def test_every_divisor_of_the_embedded_models_heads(smollm2_dir: Path) -> None:
    """SmolLM2-135M has 9 heads and 3 KV heads: 3 ranks give one rank's greedy tokens in
    float32 (chunked prefill in the mix)."""
    options = {**OPTIONS, "max_seq_len": 512, "max_extend_tokens": 64}
    prompts = [[1, 504, 3458, 282, 4649, 314] * (i + 1) for i in range(4)]
    params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)] * 4
    llm = LLM(str(smollm2_dir), skip_tokenizer_init=True, **options)
    alone = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.close()
    llm = LLM(str(smollm2_dir), skip_tokenizer_init=True, tensor_parallel_size=3, **options)
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == alone
    assert llm.runner.shard_config.num_heads == 3
    llm.close()


def test_a_killed_rank_ends_every_request_with_its_name(tiny_llama_dir: Path) -> None:
    """kill -9 of rank 1 while LLM.generate runs: every request ends "unavailable" with a
    message naming the rank and how it ended, later ones too; nothing is left running and
    no shared memory behind."""
    import signal
    import threading

    shared_memory = set(os.listdir("/dev/shm"))
    llm = LLM(str(tiny_llama_dir), skip_tokenizer_init=True, tensor_parallel_size=2,
              **OPTIONS)
    (rank1,) = ranks_of(llm)
    threading.Timer(0.5, os.kill, (rank1, signal.SIGKILL)).start()
    long = SamplingParams(max_tokens=200, ignore_eos=True)
    outputs = llm.generate([[5, 6, 7]] * 4, long, use_tqdm=False)
    outputs += llm.generate([[5, 6, 7]], long, use_tqdm=False)
    why = f"tensor-parallel rank 1 (pid {rank1}) was killed by SIGKILL; rank 0 stops"
    assert [(o.finish_reason, o.error_kind, o.error) for o in outputs] == [
        ("error", "unavailable", why)] * 5
    llm.close()
    assert not multiprocessing.active_children()
    assert set(os.listdir("/dev/shm")) <= shared_memory


def _sit_in_sync(rank: int) -> None:
    """A launched rank's work: build the round channel, then rank 2 exits and rank 1 waits
    in no collective, so only the peer watch can end it."""
    import time

    from asyncinfer.distributed.sync import RoundSync

    RoundSync(rank, 3)
    if rank == 2:
        time.sleep(2)  # let the others leave the channel's all-gather first
        os._exit(3)
    time.sleep(120)


def _lead_three_ranks(out: str) -> None:
    from asyncinfer.distributed.launch import Ranks
    from asyncinfer.distributed.sync import RoundSync

    ranks = Ranks.launch(3, "gloo", _sit_in_sync, ())
    RoundSync(0, 3)
    rank1, rank2 = ranks.processes
    rank1.join(60)
    rank2.join(5)
    Path(out).write_text(json.dumps([rank1.exitcode, rank2.exitcode]))
    os._exit(0)  # the group is broken: no teardown


def test_a_launched_rank_stops_when_another_ranks_process_is_gone(tmp_path: Path) -> None:
    """Rank 2 exits while rank 1 waits in no collective: rank 1 ends (exit status 1), as
    it would inside an NCCL collective that never returns."""
    out = tmp_path / "exits.json"
    leader = multiprocessing.get_context("spawn").Process(target=_lead_three_ranks,
                                                          args=(str(out),))
    leader.start()
    leader.join(240)
    if leader.is_alive():
        leader.kill()  # its ranks follow it (they watch rank 0's process)
    assert leader.exitcode == 0
    assert json.loads(out.read_text()) == [1, 3]


def test_vocabulary_rows_cover_the_vocabulary_once() -> None:
    for vocab, size in [(512, 2), (49152, 3), (10, 4), (7, 3)]:
        rows = [TensorParallel(r, size).vocab_rows(vocab) for r in range(size)]
        covered = [i for start, n in rows for i in range(start, start + n)]
        assert covered == list(range(vocab))


def test_a_rank_reads_only_its_parts_of_the_checkpoint(tiny_llama_dir: Path) -> None:
    """Rank 1 of 2 reads half of every split tensor from the file (rows of q/k/v, gate/up
    and the vocabulary, columns of o/down), zeros for a bias added after the sum, and its
    model loads from exactly that."""
    import torch

    from asyncinfer.config import ModelConfig
    from asyncinfer.layers.rotary import RotaryEmbedding
    from asyncinfer.models import build_model
    from asyncinfer.models.weights import iter_safetensors

    full = ModelConfig.from_pretrained(tiny_llama_dir)
    tp = TensorParallel(1, 2)
    rotary = RotaryEmbedding(full.hf_config, full.head_dim, 64, torch.device("cpu"))
    with torch.device("meta"):
        model = build_model(full.sharded(2), rotary, tp)
    model = model.to_empty(device="cpu")
    whole = dict(iter_safetensors(tiny_llama_dir))
    parts = dict(iter_safetensors(tiny_llama_dir, model.rank_part))
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(parts[q], whole[q][whole[q].shape[0] // 2:])
    down = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(parts[down], whole[down][:, whole[down].shape[1] // 2:])
    assert torch.equal(parts["model.embed_tokens.weight"], whole["model.embed_tokens.weight"][256:])
    norm = "model.layers.0.input_layernorm.weight"
    assert torch.equal(parts[norm], whole[norm])
    model.load_weights(parts.items())
    o = whole["model.layers.0.self_attn.o_proj.weight"]
    assert torch.equal(model.layers[0].self_attn.o_proj.weight, o[:, o.shape[1] // 2:])


def test_a_rank_whose_policy_diverges_stops_every_rank_in_that_round(tiny_llama_dir: Path,
                                                                     tmp_path: Path) -> None:
    """Rank 1 runs another policy than rank 0 (which the policy contract forbids): the guard
    compares the first batches they form, and both ranks stop with an error naming the
    round and the first difference; rank 0's requests end in that error, not a hang."""
    ranks = run_ranks(2, tiny_llama_dir, {**OPTIONS, "policy": "prefill_first"}, tmp_path,
                      rank_options={1: {"policy": "decode_first",
                                        "policy_options": {"max_decode_rounds": 1}}},
                      exitcodes=[0, 1])
    leader, follower = ranks
    assert "diverged in round" in follower["error"]
    assert leader["alive"] is False
    assert all("diverged in round" in (e or "") for e in leader["errors"])


def test_requests_arriving_and_cancelled_over_time_reach_every_rank(tiny_llama_dir: Path,
                                                                   tmp_path: Path) -> None:
    """Rank 0 serves requests that arrive one by one, a third cancelled mid-run; rank 1
    follows. Whatever the rounds, the finished requests' greedy tokens are one rank's, and
    nothing is held at the end (the guard compared every batch)."""
    prompts, params = workload(seed=1)
    llm = LLM(str(tiny_llama_dir), skip_tokenizer_init=True, **OPTIONS)
    alone = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.close()
    (leader, _) = run_ranks(2, tiny_llama_dir, {**OPTIONS, "online": True}, tmp_path)
    assert [t for i, t in enumerate(leader["tokens"]) if i % 3] == [
        t for i, t in enumerate(alone) if i % 3]
    assert all(t is None for t in leader["tokens"][::3])
    assert leader["held"] == [0, 0, 0]


def test_leaving_a_group_that_never_lets_go_is_bounded_and_aborts_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank stuck in a collective would keep NCCL's teardown waiting for good: leaving
    gives up after its timeout and aborts the group instead of hanging the engine's close."""
    import threading

    import torch.distributed as dist

    from asyncinfer.distributed.launch import leave_group

    release, aborted = threading.Event(), threading.Event()

    def abort() -> None:  # NCCL's abort can block on the stuck teardown as well
        aborted.set()
        release.wait(30)

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a: release.wait(30))
    monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group", abort)
    try:
        assert leave_group(timeout=0.2) is False  # returned although abort blocks
        assert aborted.wait(5)
    finally:
        release.set()
