"""EngineConfig: one frozen struct, validated once, resolved before the stages spawn.

CLI flags map one to one onto its fields (``--max-num-seqs`` -> ``max_num_seqs``). The
resolved config travels to each stage as msgpack bytes, so every process sees the same
values; nothing reads the environment after start except the debug switches in ``envs``.
"""

from __future__ import annotations

import os
import uuid
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from mpengine.addresses import check_engine_address
from mpengine.protocol import INT32_MAX

Runtime = Literal["processes", "serial", "threads"]

GiB = 1 << 30
MiB = 1 << 20
WEEK_S = 7 * 24 * 3600.0
ANNOUNCE_SLACK = 64 * 1024  # a NewRequest's bytes beyond its AddRequest's
MAX_TP = 64  # tensor-parallel ranks (readers of one broadcast ring)
MAX_DP = 64  # data-parallel replicas


def cgroups() -> list[tuple[list[str], str]]:
    """This process's cgroups, as ``/proc/self/cgroup`` lists them: (controllers, path)
    pairs; cgroup v2's unified one has no controllers. Lines of another form are left out."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    parts = [line.split(":", 2) for line in lines]
    return [(p[1].split(",") if p[1] else [], p[2]) for p in parts if len(p) == 3]


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity), fewer under a cgroup CPU quota of
    its cgroup or one above it (``cpu.max`` in cgroup v2, ``cpu.cfs_quota_us`` in v1), as
    containers limit CPUs (``docker run --cpus 1``)."""
    cpus = len(os.sched_getaffinity(0))
    for controllers, path in cgroups():
        if not controllers:
            roots, read = ["/sys/fs/cgroup"], _cpu_max
        elif "cpu" in controllers:
            # (v1 mounts the controller as "cpu,cpuacct", some hosts as "cpu" alone)
            roots, read = [f"/sys/fs/cgroup/{','.join(controllers)}", "/sys/fs/cgroup/cpu"], _cfs
        else:
            continue
        for group in _ancestors(path):
            dirs = (os.path.join(root, group.lstrip("/")) for root in roots)
            quota, period = next((q for d in dirs if (q := read(d)) is not None), (0, 0))
            if quota > 0 and period > 0:  # (no quota: "max", or -1 in v1)
                cpus = min(cpus, max(1, -(-quota // period)))
    return cpus


def _ancestors(path: str) -> list[str]:
    """``path`` and every cgroup above it, up to the root."""
    groups = [path]
    while groups[-1] not in ("/", ""):
        groups.append(os.path.dirname(groups[-1]))
    return groups


def _cpu_max(directory: str) -> tuple[int, int] | None:
    """cgroup v2's ``cpu.max`` (quota -1 for "max"), or None when unreadable."""
    try:
        with open(os.path.join(directory, "cpu.max")) as f:
            quota, period = f.read().split()[:2]
        return (-1 if quota == "max" else int(quota)), int(period)
    except (OSError, ValueError):
        return None


def _cfs(directory: str) -> tuple[int, int] | None:
    """cgroup v1's quota and period, or None when unreadable."""
    try:
        with open(os.path.join(directory, "cpu.cfs_quota_us")) as f:
            quota = int(f.read())
        with open(os.path.join(directory, "cpu.cfs_period_us")) as f:
            return quota, int(f.read())
    except (OSError, ValueError):
        return None


class EngineConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Everything the engine needs to start (``HELP`` says what each field means)."""

    model: str = "tiny"
    tokenizer: str | None = None
    runtime: Runtime = "processes"
    async_depth: Annotated[int, Meta(ge=0, le=1)] = 1
    block_size: Annotated[int, Meta(ge=1, le=1024)] = 16
    kv_cache_bytes: Annotated[int, Meta(ge=1, le=1 << 50)] | None = None
    gpu_memory_utilization: Annotated[float, Meta(gt=0.0, le=1.0)] = 0.9
    num_gpu_blocks_override: Annotated[int, Meta(ge=1, le=INT32_MAX)] | None = None  # int32 ids
    max_num_seqs: Annotated[int, Meta(ge=1, le=1 << 20)] = 256
    max_num_batched_tokens: Annotated[int, Meta(ge=1, le=INT32_MAX)] = 2048
    max_model_len: Annotated[int, Meta(ge=2, le=INT32_MAX)] | None = None
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    num_threads: Annotated[int, Meta(ge=1, le=4096)] | None = None
    tensor_parallel_size: Annotated[int, Meta(ge=1, le=MAX_TP)] = 1
    # Ranks on several hosts (vLLM's flags): node 0 runs the engine, the others
    # ``mpengine serve --headless``; every node gives the same master address and port.
    nnodes: Annotated[int, Meta(ge=1, le=MAX_TP)] = 1
    node_rank: Annotated[int, Meta(ge=0, lt=MAX_TP)] = 0
    master_addr: str = "127.0.0.1"
    master_port: Annotated[int, Meta(ge=0, le=65534)] = 0
    # Replicas of the whole engine behind one front (``data_parallel.py``); a replica's own
    # config names which one it is.
    data_parallel_size: Annotated[int, Meta(ge=1, le=MAX_DP)] = 1
    data_parallel_rank: Annotated[int, Meta(ge=0, lt=MAX_DP)] = 0
    data_parallel_routing: Literal["least_outstanding", "prefix_affinity"] = "least_outstanding"
    distributed_executor_backend: Literal["mp", "ray"] = "mp"
    cuda_visible_devices: Annotated[str, Meta(pattern=r"^[0-9A-Za-z,:_-]*$")] | None = None
    enforce_eager: bool = False
    attention_backend: Literal["auto", "torch", "native", "triton"] = "auto"
    compile_decode: bool = False
    seed: Annotated[int, Meta(ge=-(1 << 63), le=(1 << 63) - 1)] = 0
    engine_id: Annotated[str, Meta(pattern=r"^[A-Za-z0-9_]{0,16}$")] = ""
    address: str | None = None
    max_request_bytes: Annotated[int, Meta(ge=1024, le=1 << 30)] = 4 * MiB
    ring_bytes: Annotated[int, Meta(ge=256 * 1024, le=1 << 34)] = 8 * MiB
    prefix_caching: bool = True
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    swap_space: Annotated[int, Meta(ge=0, le=1 << 50)] = 4 * GiB
    pooling: Literal["auto", "last", "mean", "cls", "none"] = "auto"
    max_waiting_requests: Annotated[int, Meta(ge=1, le=INT32_MAX)] = 4096
    max_waiting_tokens: Annotated[int, Meta(ge=1, le=1 << 50)] = 1 << 20
    client_send_hwm: Annotated[int, Meta(ge=1, le=INT32_MAX)] = 1000
    auth_token: str | None = None
    advertise_host: str | None = None
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    startup_timeout: Annotated[float, Meta(gt=0, le=WEEK_S)] = 300.0
    # A stage that dies is restarted (the output processor, the executor), at most this often in
    # ``stage_restart_window_s``; past it the engine dies (EngineDeadError). 0: never.
    max_stage_restarts: Annotated[int, Meta(ge=0, le=1000)] = 3
    stage_restart_window_s: Annotated[float, Meta(gt=0, le=WEEK_S)] = 60.0
    trace: str | None = None
    generation_config: str = "auto"

    def __post_init__(self) -> None:
        # Found out at start, not when the stages write their parts at the end.
        if self.trace and not os.path.isdir(folder := os.path.dirname(os.path.abspath(self.trace))):
            raise ValueError(f"trace: the folder {folder!r} does not exist")
        if self.trace and os.path.isdir(self.trace):
            raise ValueError(f"trace: {self.trace!r} is a folder: give a file to write")
        if self.address:
            check_engine_address(self.address)
        if self.tensor_parallel_size > 1 and self.runtime != "processes":
            raise ValueError(
                f"tensor_parallel_size {self.tensor_parallel_size} needs the processes "
                f"runtime (an executor process per rank), not {self.runtime!r}"
            )
        if self.tensor_parallel_size % self.nnodes or self.node_rank >= self.nnodes:
            raise ValueError(
                f"nnodes {self.nnodes} must divide tensor_parallel_size "
                f"{self.tensor_parallel_size}, and node_rank {self.node_rank} be below it"
            )
        if self.data_parallel_rank >= self.data_parallel_size:
            raise ValueError(
                f"data_parallel_rank {self.data_parallel_rank} must be below "
                f"data_parallel_size {self.data_parallel_size}"
            )
        if self.data_parallel_size > 1 and self.nnodes > 1:
            raise ValueError(
                "data_parallel_size above 1 with nnodes above 1: place replicas on other hosts "
                "with --distributed-executor-backend ray, or serve them there (mpengine serve "
                "--headless) and front them with --engine-address"
            )
        if self.nnodes > 1 and not self.master_port:
            raise ValueError("nnodes above 1 needs master_port (the same on every node)")
        # A request is announced to the output processor in one ring frame.
        if self.ring_bytes < self.max_request_bytes + ANNOUNCE_SLACK:
            raise ValueError(
                f"ring_bytes ({self.ring_bytes}) must be at least max_request_bytes "
                f"({self.max_request_bytes}) + {ANNOUNCE_SLACK}: every request crosses a ring "
                "in one frame"
            )

    def resolve(self) -> EngineConfig:
        """Derived defaults that need no model: engine id, trace path."""
        updates: dict = {}
        if not self.engine_id:
            updates["engine_id"] = uuid.uuid4().hex[:8]
        if self.trace:
            # Stages write their parts at exit; the caller's cwd may have changed by then.
            updates["trace"] = os.path.abspath(self.trace)
        return msgspec.structs.replace(self, **updates) if updates else self

    @property
    def max_threads(self) -> int:
        """The executor's torch threads: ``num_threads``, else every core, less one for the
        scheduler and output stages beside it on machines with more than two. Those stages
        take a few percent of a core: on two cores, leaving one to them halves the forward's
        compute (all-MiniLM-L6-v2 embedding 1.6x, the small model generating 1.2-1.45x
        faster with both; tools/bench_embed.py, bench_engine.py). Without ``num_threads``,
        a CPU executor runs each size of step with one thread or these, whichever it times
        faster (``executor/threads.py``). Tensor-parallel ranks and data-parallel replicas
        split the cores: each takes its share (``num_threads`` is per rank)."""
        if self.num_threads is not None:
            return self.num_threads
        cores = available_cpus()
        overlapped = self.runtime in ("processes", "threads") and cores > 2
        sharers = self.ranks_per_node * self.data_parallel_size
        return max(1, (cores - 1 if overlapped else cores) // sharers)

    @property
    def ranks_per_node(self) -> int:
        """Tensor-parallel ranks on each host."""
        return self.tensor_parallel_size // self.nnodes

    @property
    def num_slots(self) -> int:
        """Executor state slots: a finished sequence keeps its slot until no planned step
        still touches it, so under async depth 1 up to twice ``max_num_seqs`` are held."""
        return 2 * self.max_num_seqs

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @classmethod
    def decode(cls, data: bytes) -> EngineConfig:
        return msgspec.msgpack.decode(data, type=cls)

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> EngineConfig:
        """Build and validate (constraints are only checked when converting)."""
        return msgspec.convert(kwargs, cls)


HELP = {
    "model": "a local Hugging Face model directory, a hub id (org/name) already in the local "
    "Hugging Face cache (never downloaded), or a built-in tiny model: tiny (Qwen3), tiny-llama, "
    "tiny-gpt2, small, qwen3-0.6b-shape and qwen3-embedding-0.6b-shape (Qwen3-0.6B's "
    "dimensions, random weights), tiny-bert "
    "(an encoder: embeddings), tiny-embed (a decoder with last-token pooling: embeddings and "
    "generation)",
    "tokenizer": "tokenizer directory (default: the model directory)",
    "runtime": "processes: scheduler, executor and output processor as three OS processes; "
    "serial: one process, one loop (debugging, baseline); threads: the three as threads of "
    "one process (a comparison: they share the GIL)",
    "async_depth": "how many steps the scheduler may run ahead of output processing (0 or 1)",
    "block_size": "tokens per KV cache block",
    "kv_cache_bytes": "KV cache size on the CPU, in bytes or with a unit (4GiB; default 1 GiB; "
    "its memory is taken as its blocks are first used, so the executor's RSS grows up to it "
    "under load)",
    "gpu_memory_utilization": "fraction of the GPU's total memory this engine may use: weights, "
    "activations and KV cache (CUDA only)",
    "num_gpu_blocks_override": "exact number of KV blocks, overriding the byte sizing",
    "max_num_seqs": "most sequences in one step",
    "max_num_batched_tokens": "token budget of one step (longer prompts are chunked)",
    "max_model_len": "longest prompt + output (default: the model's maximum positions)",
    "dtype": "model and KV cache dtype (auto: float32 on the CPU; on CUDA a float16 or "
    "bfloat16 checkpoint's own, else bfloat16; vLLM's half and float are float16 and float32)",
    "device": "where the model runs",
    "num_threads": "torch threads in the executor (default: on the CPU, one or all cores, "
    "whichever runs each size of step faster, timed as it runs; all cores but one in the "
    "processes and threads runtimes on machines with more than two)",
    "tensor_parallel_size": "executor processes that split the model by its tensor-parallel "
    "plan (torch.distributed: NCCL, one GPU each, or gloo on the CPU, the cores split between "
    "them); decoders whose transformers config has a plan (llama, qwen, mistral...)",
    "nnodes": "hosts the tensor-parallel ranks are spread over, as many on each (node 0 runs "
    "the engine, the others 'mpengine serve --headless')",
    "node_rank": "this host's place among the nnodes (0: the engine's)",
    "master_addr": "node 0's address, where the ranks' process group meets and rank 0 "
    "publishes the plans to the other nodes (on master_port + 1)",
    "master_port": "the ranks' process group port on master_addr (default: a free one, for "
    "one node; with nnodes above 1, give it on every node)",
    "data_parallel_size": "replicas of the whole engine (its own stages, KV cache and devices "
    "each: a GPU each when there are enough, else shares of one; on the CPU the cores split) "
    "behind one front that routes each request to one of them",
    "data_parallel_rank": "which replica this engine is (set for each replica by the launcher)",
    "data_parallel_routing": "how requests are spread over the replicas: least_outstanding "
    "(fewest in flight) or prefix_affinity (where the prompt's first blocks ran, while the "
    "load stays even; client/routing.py)",
    "distributed_executor_backend": "where replicas run: mp (processes of this host) or ray "
    "(a Ray actor each, on whichever node of the Ray cluster has the resources; "
    "pip install 'mpengine[ray]'; RAY_ADDRESS names the cluster, else the one this host "
    "joined with 'ray start', else a local one starts)",
    "cuda_visible_devices": "the GPUs this engine's processes see (CUDA_VISIBLE_DEVICES; "
    "data-parallel replicas get a slice each when there are enough)",
    "enforce_eager": "never replay CUDA graphs: run every step eagerly (CUDA only; decode "
    "steps are captured as graphs at start-up otherwise)",
    "attention_backend": "paged attention kernels: auto (triton on CUDA; on the CPU native, "
    "C kernels built on first use with the system's C compiler, or torch without one), torch "
    "(gathers and SDPA, the reference), native (CPU only), triton",
    "compile_decode": "torch.compile the model for pure-decode steps (CPU, native attention): "
    "1.1-1.4x faster decode steps for 20-40 s more at start-up per thread count the executor "
    "may use",
    "seed": "seed of the sampler for requests without their own seed",
    "engine_id": "names the engine's shm segments and runtime directory (default: random)",
    "address": "ipc:///DIR for DIR/requests.sock and DIR/outputs.sock (default: a private "
    "runtime directory), or tcp://HOST:PORT (requests on PORT, outputs on PORT+1)",
    "max_request_bytes": "largest request frame a client may send (bytes, or with a unit)",
    "ring_bytes": "capacity of each shared-memory ring (at least max_request_bytes + 64 KiB; "
    "plans and results are bounded to fit, see docs/internals.md)",
    "prefix_caching": "reuse the KV cache of prompts that share a prefix (automatic prefix "
    "caching by block hash; --no-prefix-caching turns it off)",
    "preemption_mode": "what a sequence preempted for lack of KV blocks loses: recompute "
    "(its blocks are dropped; it resumes by recomputing prompt and outputs) or swap (its "
    "blocks are copied to host memory and back when it resumes; recompute when the swap "
    "space is full, and for sequences with penalties or pooling)",
    "swap_space": "host memory for swapped-out KV blocks (pinned on a GPU): on the command "
    "line GiB as vLLM takes it (4) or a size with a unit (512MiB); in bytes in the Python API",
    "scheduling_policy": "fcfs (arrival order) or priority (each request's priority, lower "
    "first, then arrival: it orders admission, resumption and which sequence is preempted)",
    "pooling": "how embeddings pool hidden states: auto (what the model directory's "
    "sentence-transformers files say; a base or encoder model without them pools the last "
    "token or CLS; a causal LM without them does not embed), last, mean, cls, or none (no "
    "embeddings)",
    "max_waiting_requests": "most requests queued before admission; past it a request fails "
    "at once with an 'overloaded' error",
    "max_waiting_tokens": "most prompt tokens queued before admission ('overloaded' past it)",
    "client_send_hwm": "output messages queued for one client that does not read them; past "
    "it that client's requests are aborted",
    "auth_token": "a secret every client must present (tcp:// engines reachable by others)",
    "advertise_host": "host clients should connect to for outputs when the address binds a "
    "wildcard (default: the host the client used for requests)",
    "log_level": "log level of every stage (DEBUG logs each scheduling decision)",
    "startup_timeout": "seconds to wait for the stages to load and report ready",
    "max_stage_restarts": "restarts of a stage that died (the output processor, the executor) in "
    "--stage-restart-window-s; past them the engine dies (0: never restart)",
    "stage_restart_window_s": "the window --max-stage-restarts counts restarts in",
    "generation_config": "default sampling parameters of requests that leave them out: auto "
    "(the model directory's generation_config.json: temperature, top_p, top_k, min_p, "
    "repetition_penalty, max_new_tokens as max_tokens, as vLLM reads them), none (the "
    "engine's own; vLLM's 'vllm' is taken too), or a directory with a generation_config.json",
    "trace": "write a Chrome trace (Perfetto, chrome://tracing) of every stage's steps, phases "
    "and waits to this file when the engine stops (each stage process keeps its last 200k "
    "spans)",
}
