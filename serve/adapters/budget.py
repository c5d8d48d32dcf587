"""A Trans-LoRA transfer's time budget (`--budget-min`): the target writes inputs for at most WRITING of it, the
student trains until TRAINING of it has passed (keeping its best validated point), and the rest is left to the
teacher and the guard's comparison. A platform moving every tenant's adapter plans by such a bound; the report
says what the budget cut."""

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from serve.errors import ConfigError

MINUTES = 30.0
"""The default budget (`manyfold translora --budget-min`, and every transfer of `manyfold bench translora`): one
transfer of a 128-example adapter took 19.8 minutes on a 2-core CPU."""
MINUTES_MEASURED = 19.8
"""That transfer's minutes (bench-results, Trans-LoRA: SmolLM2-135M to its new version, 128 inputs wanted, on
an Intel Xeon with 2 cores): what an upgrade's estimate scales (serve/adapters/upgrade.py) until the upgrade has
timed transfers of its own. It trained one student (SECOND_STUDENT: where a transfer trains two)."""
SECOND_STUDENT = 0.4
"""How much longer a transfer runs, at most, where it trains a second student (students.py: the filter refused a
quarter or more of the inputs, unless --filtered-only): 18-39% more on the bench's deeper-5 cells, which ran
alone (bench-results, "The synthetic inputs, measured per target"). Whether it will is known only once the
inputs are written, so a dry run gives the range."""
PARAMS_MEASURED = 134_515_008
"""SmolLM2-135M's parameters, the base of that transfer."""
WRITING = 0.5
"""The share of the budget after which no more candidate inputs are written."""
TRAINING = 0.85
"""The share of the budget after which the student stops training."""


@dataclass
class Budget:
    minutes: float | None
    """None: no bound."""
    started: float = field(default_factory=time.monotonic)
    cut: list[str] = field(default_factory=list)
    """The parts the budget ended early ("writing", "training"), in order."""

    def __post_init__(self):
        if self.minutes is not None and not self.minutes > 0:
            raise ConfigError(f"a transfer's budget must be > 0 minutes; got {self.minutes}")

    def until(self, share: float, part: str) -> Callable[[], bool]:
        """Whether `share` of the budget has passed, asked as `part` goes on; the first yes is recorded as a cut."""
        def out_of_time() -> bool:
            over = self.minutes is not None and time.monotonic() - self.started >= share * self.minutes * 60
            if over and part not in self.cut:
                self.cut.append(part)
            return over
        return out_of_time

    def summary(self) -> dict:
        return {"minutes": self.minutes, "spent_minutes": round((time.monotonic() - self.started) / 60, 2),
                "cut": list(self.cut)}
