#!/usr/bin/env bash
# tests/prepare.sh: install and start what the test suite needs and this machine lacks.
# `make test` runs it first (and so does .ci/run, through `make test`). As root it installs
# what is missing from Debian's packages and starts PostgreSQL; as another user it says, one
# line per missing part, what to install, and the tests that need that part skip with the
# reason (under CI=true they fail instead). Safe to run again: it changes nothing that is there.
set -euo pipefail

need=()        # Debian packages to install
why=()         # what each missing part is for, for a non-root user
missing() { need+=("$1"); why+=("$2"); }

# Debian's python3 has the venv module but not ensurepip, without which `python3 -m venv` fails
python3 -c 'import ensurepip' >/dev/null 2>&1 || missing python3-venv "the virtualenv (.venv)"
command -v munged >/dev/null || missing munge "the MUNGE authentication tests"
command -v pg_ctlcluster >/dev/null || missing postgresql "the store tests on PostgreSQL"
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null; then
    missing "slurmctld slurmd slurm-client" "the Slurm Prolog/Epilog/job_submit tests"
fi
command -v sshd >/dev/null || [ -x /usr/sbin/sshd ] ||
    missing "openssh-server openssh-client" "the SSH transport tests"
command -v ip >/dev/null || missing iproute2 "the network partition fault tests"
command -v promtool >/dev/null || missing prometheus "the promtool check of /metrics"
command -v lua5.1 >/dev/null || command -v lua >/dev/null ||
    missing lua5.1 "the test of daemon/job_submit.lua against the Prolog's grammar"

if ((${#need[@]})); then
    if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
        echo "prepare: installing ${need[*]}"
        apt-get update -qq
        # shellcheck disable=SC2068 # a list entry may name several packages
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends ${need[@]} >/dev/null
    else
        for i in "${!need[@]}"; do
            echo "prepare: missing for ${why[$i]} (they skip): apt-get install ${need[$i]}" >&2
        done
    fi
fi

# PostgreSQL on 127.0.0.1:5432 with a database `test` the tests may create databases from.
if command -v pg_ctlcluster >/dev/null && [ "$(id -u)" -eq 0 ]; then
    if ! pg_isready -q -h 127.0.0.1 -p 5432; then
        version=$(ls /etc/postgresql | sort -V | tail -n 1)
        # the tests' port: pg_createcluster gives the next free one when 5432 is taken at install
        if [ "$(pg_conftool -s "$version" main show port)" != 5432 ]; then
            pg_conftool "$version" main set port 5432
            pg_ctlcluster --skip-systemctl-redirect "$version" main stop 2>/dev/null || true
        fi
        pg_ctlcluster --skip-systemctl-redirect "$version" main start
        for _ in $(seq 50); do pg_isready -q -h 127.0.0.1 -p 5432 && break; sleep 0.2; done
        pg_isready -q -h 127.0.0.1 -p 5432 || {
            echo "prepare: PostgreSQL $version/main started but does not answer on 127.0.0.1:5432" >&2
            exit 1
        }
    fi
    if ! psql -h 127.0.0.1 -U postgres -d test -tAc 'select 1' >/dev/null 2>&1; then
        # a stock install: allow local TCP connections as postgres without a password, add `test`
        version=$(ls /etc/postgresql | sort -V | tail -n 1)
        hba=/etc/postgresql/$version/main/pg_hba.conf
        grep -q '^host all all 127.0.0.1/32 trust' "$hba" ||
            sed -i '1i host all all 127.0.0.1/32 trust' "$hba"
        pg_ctlcluster --skip-systemctl-redirect "$version" main reload
        runuser -u postgres -- psql -tAc "select 1 from pg_database where datname = 'test'" |
            grep -q 1 || runuser -u postgres -- createdb test
    fi
elif ! pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; then
    echo "prepare: no PostgreSQL on 127.0.0.1:5432 (as root this script starts one); those tests skip" >&2
fi
