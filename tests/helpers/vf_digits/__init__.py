"""A verifiers (0.4) taskset without tools, for the tiny character model: write the digit asked for (a system
prompt and a question), rewarded when the reply holds it. Loaded by id: ``vf_digits``."""

import verifiers.v1 as vf


class DigitData(vf.TaskData):
    answer: str


class DigitTask(vf.Task[DigitData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task: DigitData, trace: vf.Trace) -> float:
        return float(task.answer in (trace.last_reply or ""))


class DigitTaskset(vf.Taskset[DigitTask, vf.TasksetConfig]):
    def load(self):
        for digit in range(10):
            yield DigitTask(DigitData(prompt=f"{digit}=", answer=str(digit)), self.config.task)


__all__ = ["DigitTaskset"]
