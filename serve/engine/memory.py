"""What a replica's memory holds, and what `neuzip_decoded_mib: auto` leaves its NeuZip bases to keep decoded.

The plan follows vLLM's profile run: load every base with nothing kept decoded, measure what the process then
holds (resident), measure one forward at the largest batch (working: activations, plus on a CPU the KV store,
whose pages become resident as rows write them), add the budgets that fill later (reserved: the variant cache's tiers,
the adapter pool, EMR formed weights), and what the target leaves after those is decoded for good. On a CPU engine
memory is the process's resident set; on CUDA it is the device's allocated bytes.
"""

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from serve.config import ServeConfig

PROFILE_TOKENS = 512
"""Tokens a row of the profile forward has: working memory is sized for prompts this long (longer ones are served,
beyond the plan)."""
PROFILE_ROWS = 16
"""Rows of the profile forward at most: a generation step holds batch.max_step_tokens tokens whatever its rows,
and an encoder's forwards are planned at up to this many rows of PROFILE_TOKENS."""
MIB = 1 << 20


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes, for the snapshot and the startup log."""

    target: int
    resident: int
    working: int
    reserved: int
    decoded: int = 0
    """What the NeuZip bases keep decoded, once `keep` has run (at most `free`)."""

    @property
    def free(self) -> int:
        return max(0, self.target - self.resident - self.working - self.reserved)

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "free": self.free}

    def describe(self) -> str:
        mib = {k: v / MIB for k, v in self.to_dict().items()}
        return (f"memory target {mib['target']:.0f} MiB: {mib['resident']:.0f} resident with nothing decoded, "
                f"{mib['working']:.0f} for a forward at the largest batch, {mib['reserved']:.0f} for the caches' "
                f"and slots' budgets -> {mib['decoded']:.0f} MiB of NeuZip weights kept decoded")


def resident_bytes(device: torch.device) -> int:
    """What this process holds now: its resident set (CPU) or the device's allocated bytes (CUDA)."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return _status_kib("VmRSS") << 10


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM, the peak resident set (Linux >= 4.0)


def peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return _status_kib("VmHWM") << 10


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def reserved_bytes(config: ServeConfig, emr_groups: int) -> int:
    """The budgets that fill as variants come: the cache's tiers (on CUDA only its device tier is device
    memory), each base's adapter pool, its full fine-tunes' pool (a CPU holds none) and each EMR group's formed
    weights."""
    on_cpu = config.device == "cpu"
    cache = config.cache.device_mib + (config.cache.cpu_mib if on_cpu else 0)
    pools = config.slots.adapter_mib + (0 if on_cpu else config.slots.weights_mib)
    return (cache + pools + emr_groups * config.slots.emr_formed_mib) * MIB


@torch.no_grad()
def working_bytes(rt, rows: int) -> int:
    """One forward's own memory at `rows` rows of PROFILE_TOKENS tokens (measured: its peak over what was held
    before it), plus on a CPU a causal LM's KV store (allocated at load, its pages resident only once written;
    on CUDA it is already in the resident bytes)."""
    from serve.engine.step.batch import BASE_ROW, BatchPlan

    tokens = min(PROFILE_TOKENS, rt.max_input_tokens)
    ids = torch.randint(0, rt.model.config.vocab_size, (rows, tokens), device=rt.device)
    plan = BatchPlan([BASE_ROW] * rows, rt.device)
    reset_peak(rt.device)
    before = resident_bytes(rt.device)
    rt.call(plan, input_ids=ids, **({"use_cache": False, "logits_to_keep": 1} if rt.causal else {}))
    activations = max(0, peak_bytes(rt.device) - before)
    kv = rt.kv.nbytes if rt.kv is not None and rt.device.type == "cpu" else 0
    return activations + kv
