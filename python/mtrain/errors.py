"""The exception every mtrain call raises: MtrainError, carrying mtrain's
status (mtrain_status_name, e.g. "MTRAIN_ERR_SHAPE_MISMATCH") and message
(mtrain_last_error, or the Python boundary's own check)."""

from __future__ import annotations


class MtrainError(RuntimeError):
    """An mtrain failure.

    Attributes:
        code: the mtrain_status_t value (negative).
        status: its name, as mtrain_status_name gives it.
        message: what went wrong (which argument, which value, which rank).
    """

    def __init__(self, code: int, status: str, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.code = code
        self.status = status
        self.message = message

    def __reduce__(self) -> tuple[type[MtrainError], tuple[int, str, str]]:
        # picklable across torch.multiprocessing workers
        return (MtrainError, (self.code, self.status, self.message))
