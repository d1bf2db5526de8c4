"""Scheduled retraining as configured: which adapter to retrain, on what data, when."""

from dataclasses import dataclass

from mint_core.errors import ConfigurationError


@dataclass(frozen=True)
class RetrainSchedule:
    """Retrain `adapter` on the data at `data` (a path or s3:// URI, read afresh at each run) on
    a cron schedule (a Prefect deployment serves it)."""

    adapter: str
    data: str
    cron: str

    def __str__(self) -> str:
        return f"{self.adapter}|{self.data}|{self.cron}"

    @classmethod
    def parse_all(cls, text: str) -> tuple["RetrainSchedule", ...]:
        """`adapter|data|cron` entries separated by `;`, e.g.
        `support-bot|s3://team/support.jsonl|0 3 * * *;faq-bot|/data/faq.jsonl|30 3 * * 1`."""
        schedules = []
        for entry in filter(None, (part.strip() for part in text.split(";"))):
            parts = [part.strip() for part in entry.split("|")]
            if len(parts) != 3 or not all(parts) or len(parts[2].split()) != 5:
                raise ConfigurationError(
                    f"retrain schedule {entry!r} is not 'adapter|data file|<cron with 5 "
                    "fields>', e.g. 'support-bot|/data/support.jsonl|0 3 * * *'"
                )
            schedules.append(cls(*parts))
        return tuple(schedules)
