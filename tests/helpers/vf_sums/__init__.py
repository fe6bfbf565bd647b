"""A verifiers (0.4) taskset as a user writes one for prime-rl: in-memory sums, a reward, and an ``add`` tool served
once for the run (``vf_sums.tools``). Loaded by id: ``vf_sums``."""

import verifiers.v1 as vf

from vf_sums.tools import Adder

ROWS = [{"question": "What is 3 + 4?", "answer": "7"}, {"question": "What is 2 + 6?", "answer": "8"}]


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task: SumData, trace: vf.Trace) -> float:
        return float(task.answer in (trace.last_reply or ""))

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply or ""))


class SumTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
    @classmethod
    def toolsets(cls, config):
        return [Adder(vf.ToolsetConfig())]

    def load(self):
        for row in ROWS:
            yield SumTask(SumData(prompt=row["question"], answer=row["answer"]), self.config.task)


__all__ = ["SumTaskset"]
