#!/bin/bash
# How often srun hangs at the end of a heterogeneous pmix step, with and without mpirl's exit
# stagger (mpirl.runtime.layout.het_exit_delay); see docs/slurm.md. Uses the local test cluster:
#     eval "$(slurm/local-cluster.sh env)"; slurm/local-cluster.sh start
#     slurm/het-exit-race.sh [JOBS]        # JOBS per mode, default 40; about 6 s a job
#     MODES=stagger slurm/het-exit-race.sh  # one mode only (default: "none stagger")
# Each job is 2 tasks of component 0 on n2 and 1 of component 1 on the first node, running a
# program that does MPI_Init, a barrier and MPI_Finalize and exits: at once ("none"), or after
# het_exit_delay ("stagger": 2 s for component 1 where srun is older than 24.11). A job still
# queued or running after 30 s is counted hung and cancelled. Prints one line per mode: "<mode>: <hung> hung of <jobs>".
set -euo pipefail
JOBS=${1:-40}
REPO=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
WORK=$(mktemp -d /tmp/het-exit-race.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
cat > "$WORK/program.py" <<'PY'
import os, sys, time
from mpi4py import MPI
MPI.COMM_WORLD.Barrier()
MPI.Finalize()
if sys.argv[1] == "stagger":
    from mpirl.runtime.layout import het_exit_delay
    time.sleep(het_exit_delay())
os._exit(0)
PY
cat > "$WORK/job.sh" <<SH
#!/bin/bash
#SBATCH --nodelist=n2 --ntasks=2 --partition=all --time=2
#SBATCH hetjob
#SBATCH --ntasks=1 --partition=all --time=2
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
srun --mpi=pmix --het-group=0,1 "$PYTHON" "$WORK/program.py" "\$1"
SH
for mode in ${MODES:-none stagger}; do
    hung=0
    for _ in $(seq 1 "$JOBS"); do
        job=$(sbatch --parsable --output=/dev/null "$WORK/job.sh" "$mode")
        start=$(date +%s)
        while squeue -h -j "$job" 2>/dev/null | grep -q .; do
            sleep 0.5
            if [ $(( $(date +%s) - start )) -gt 30 ]; then
                hung=$((hung + 1)); scancel "$job"; sleep 2; break
            fi
        done
    done
    echo "$mode: $hung hung of $JOBS"
done
