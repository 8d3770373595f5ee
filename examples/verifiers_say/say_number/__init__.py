"""A verifiers environment (the `verifiers.v1` API): say a number back. Two weighted rewards make its rubric."""

import verifiers.v1 as vf


class SayData(vf.TaskData):
    answer: str = ""


class SayTask(vf.Task[SayData]):
    @vf.reward(weight=1.0)
    async def exact(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == self.data.answer)

    @vf.reward(weight=0.2)
    async def short(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply.strip()) <= 4)


class SayConfig(vf.TasksetConfig):
    num_tasks: int = 50


class SayTaskset(vf.Taskset[SayTask, SayConfig]):
    def load(self):
        return [
            SayTask(
                SayData(prompt=f"Reply with the number {i} and nothing else.", answer=str(i)),
                self.config.task,
            )
            for i in range(self.config.num_tasks)
        ]


__all__ = ["SayTaskset"]
