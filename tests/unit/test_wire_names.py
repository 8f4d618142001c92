"""The one grammar of each name: what the store, the protocol and the Prolog accept alike."""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_cdgpc.errors import InputError
from slurm_cdgpc.slurm.env import read_hook_env
from slurm_cdgpc.slurm.spool import Spool, SpoolRecord
from slurm_cdgpc.wire import names
from slurm_cdgpc.wire.protocol import ProtocolError, job_id

JOB_IDS = ["1", "123", "4294967295", "123_4", "123_0", "123+1", "123+0", "9999999999_1234567890"]
NOT_JOB_IDS = ["", "0", "0123", "01_2", "123_04", "123+01", "12345678901", "1_12345678901",
               "123_", "_4", "+1", "1_2_3", "1+2+3", "1_2+3", "12.1", " 1", "1\n", "١٢",
               "1a"]  # fmt: skip


@pytest.mark.parametrize("text", JOB_IDS)
def test_slurms_job_ids_are_accepted_everywhere(text: str, tmp_path: Path) -> None:
    assert names.job_id(text) == job_id(text) == text
    assert read_hook_env({"SLURM_JOB_ID": text, "SLURM_JOB_USER": "alice"}).job_id == text
    spool = Spool(tmp_path)
    spool.spool("deregister", text)
    [path] = spool.pending()  # the spool's file names take every job id
    assert SpoolRecord.from_json(path.read_bytes()).job_id == text


@pytest.mark.parametrize("text", NOT_JOB_IDS)
def test_anything_else_is_refused_everywhere_with_one_message(text: str) -> None:
    with pytest.raises(InputError, match="job_id: must be a Slurm job id like 123 or 123_4"):
        names.job_id(text)
    with pytest.raises(ProtocolError, match=r"setpoints\.job_id: must be a Slurm job id"):
        job_id(text, "setpoints.job_id")
    with pytest.raises(InputError, match="SLURM_JOB_ID: must be a Slurm job id"):
        read_hook_env({"SLURM_JOB_ID": text, "SLURM_JOB_USER": "alice"})


def test_node_names_are_host_names() -> None:
    for good in ("n1", "gpu-01", "node_7", "a.b.example", "A" * 255, "1"):
        assert names.node_name(good) == good
    for bad in ("", "-n1", "n1-", ".n1", "n1.", "n 1", "n1;rm", "A" * 256, "../etc", 1, None):
        with pytest.raises(InputError, match="node: must be a host name"):
            names.node_name(bad)


def test_accounts_are_user_or_group_names() -> None:
    for good in ("alice", "_svc", "bob.smith", "ws01$", "a" * 64, "a" * 63 + "$"):
        assert names.account(good) == good
    for bad in ("", "-alice", "a b", "$", "a$b", "a" * 65, "a" * 64 + "$", "slurm;rm", 7):
        with pytest.raises(InputError, match="user: must be a user or group name"):
            names.account(bad)
