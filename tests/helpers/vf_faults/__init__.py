"""``vf_digits`` with a second reward, ``parsed_digit``, that fails as user code can: it raises (``fault: raises``:
``int()`` of a reply that is not a number), returns ``None`` (``returns_none``), or hangs for ``hang_s`` seconds
(``hangs``: a blocking sleep, which holds verifiers' event loop; ``awaits``: an awaited one). Loaded by id:
``vf_faults``, the fault a task option (``{taskset: {id: vf_faults, task: {fault: raises}}}``)."""

import asyncio
import time

import verifiers.v1 as vf
from vf_digits import DigitData


class FaultConfig(vf.TaskConfig):
    fault: str = "raises"
    hang_s: float = 3600.0


class FaultTask(vf.Task[DigitData, vf.State, FaultConfig]):
    @vf.reward
    async def correct(self, task: DigitData, trace: vf.Trace) -> float:
        return float(task.answer in (trace.last_reply or ""))

    @vf.reward
    async def parsed_digit(self, task: DigitData, trace: vf.Trace) -> float | None:
        reply = trace.last_reply or ""
        if self.config.fault == "raises":
            return float(int(reply) == int(task.answer))
        if self.config.fault == "hangs":
            time.sleep(self.config.hang_s)
        if self.config.fault == "awaits":
            await asyncio.sleep(self.config.hang_s)
        return None if self.config.fault == "returns_none" else 1.0


class FaultTasksetConfig(vf.TasksetConfig):
    task: FaultConfig = FaultConfig()


class FaultTaskset(vf.Taskset[FaultTask, FaultTasksetConfig]):
    def load(self):
        for digit in range(10):
            yield FaultTask(DigitData(prompt=f"{digit}=", answer=str(digit)), self.config.task)


__all__ = ["FaultTaskset"]
