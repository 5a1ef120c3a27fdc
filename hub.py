"""Hugging Face Hub references checked before anything heavy: one line, at once, when a model or data set
is neither in the local cache nor reachable (instead of a minute of retries and a long traceback)."""

from __future__ import annotations

import os


def require(repo_id: str, repo_type: str, flag: str, cached_file: str) -> None:
    """Return when `repo_id` is cached (`cached_file` present) or the hub answers for it; else stop."""
    from huggingface_hub import HfApi, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    if isinstance(try_to_load_from_cache(repo_id, cached_file, repo_type=repo_type), str):
        return
    kind = "model" if repo_type == "model" else "data set"
    local = "a local directory" if repo_type == "model" else "a local .jsonl/.json/.parquet/.csv file"
    hint = (f"use {local}, or download it where the hub is reachable (huggingface-cli download "
            f"{'--repo-type dataset ' if repo_type == 'dataset' else ''}{repo_id}) and run with HF_HUB_OFFLINE=1")
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        raise SystemExit(f"{flag} {repo_id}: the {kind} is not in the local cache and HF_HUB_OFFLINE forbids "
                         f"downloading it: {hint}")
    info = HfApi().model_info if repo_type == "model" else HfApi().dataset_info
    try:
        info(repo_id, timeout=10)
    except GatedRepoError:
        return  # reachable; the download says how to get access
    except RepositoryNotFoundError:
        raise SystemExit(f"{flag} {repo_id}: no such {kind} on the hub (or it is private: huggingface-cli login)"
                         ) from None
    except HfHubHTTPError:
        return  # the hub answered; the download reports anything else
    except Exception as e:  # noqa: BLE001 - no connection at all: DNS, refused, timeout, proxy
        raise SystemExit(f"{flag} {repo_id}: the Hugging Face Hub cannot be reached ({e}) and the {kind} is not "
                         f"in the local cache: {hint}") from None
