#!/usr/bin/env bash
# Issue 18's GPU checks in one go, on a machine with an NVIDIA GPU whose python3 holds a CUDA
# build of torch (benchmarks/RESULTS.md records the run on an H200):
#   the GPU tests; mpirl doctor with one learner and with two sharing the GPU (mpi, gloo, nccl);
#   NCCL itself with two ranks on one GPU; benchmarks/learner_throughput.py; PPO and IMPALA on
#   CartPole with their learner on the GPU and, side by side, on the CPU.
#
#   OUT=/tmp/gpu-session bash benchmarks/gpu_session.sh
#
# A machine without a package index gets mpirl's dependencies as wheels in .whl/ (downloaded
# elsewhere for its Python); mpirl itself is installed from this checkout. Each step has its own
# time limit, and one that fails does not stop the others (SKIP_INSTALL=1: use what is installed).
# STEPS picks some of: tests doctor nccl throughput cartpole (default all). Everything lands in $OUT.
set -u
OUT=${OUT:-gpu-session}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
exec > >(tee "$OUT/session.log") 2>&1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONUNBUFFERED=1
STEPS=${STEPS:-tests doctor nccl throughput cartpole}
step() { echo; echo "=== $* ($(date -u +%T))"; }
wanted() { [[ " $STEPS " == *" $1 "* ]]; }

step install
if [ "${SKIP_INSTALL:-}" != 1 ]; then
    if [ -d .whl ]; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl || exit 1
    fi
    $PY -m pip install -q --no-index --no-deps --no-build-isolation --use-pep517 -e . || exit 1
fi
BIN=$(dirname "$(command -v $PY)")
MPIEXEC=("$BIN/mpiexec" --oversubscribe --bind-to none)
"$BIN/mpiexec" --version | head -1

step machine
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
$PY - <<'EOF'
import os, platform, torch
print(f"python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda},"
      f" NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, cuDNN "
      f"{torch.backends.cudnn.version()}, {torch.cuda.device_count()} GPU(s), "
      f"{len(os.sched_getaffinity(0))} usable cores")
EOF

if wanted tests; then
step "GPU tests, and the learner and doctor tests with the GPU present"
timeout 300 $PY -m pytest -q -p no:cacheprovider -o addopts="-ra" tests/test_gpu.py \
    tests/test_learners.py tests/test_dispatch.py -k "gpu or learner or doctor or nccl"

fi

if wanted doctor; then
step "mpirl doctor: one learner on the GPU, then two sharing it"
for backend in auto mpi gloo nccl; do
    learners=$([ $backend = auto ] && echo 1 || echo 2)
    echo "--- $learners learner(s), learner_backend $backend"
    timeout 120 "${MPIEXEC[@]}" -n $((learners + 2)) $PY -m mpirl doctor --pings 20 --config \
        "{\"num_learners\": $learners, \"learner_backend\": \"$backend\"}" 2>&1 | tail -8
done

fi

if wanted nccl; then
step "NCCL itself with two ranks on one GPU (mpirl refuses this before NCCL starts)"
cat > /tmp/nccl_two_ranks_one_gpu.py <<'EOF'
import torch
import torch.distributed as dist
from mpi4py import MPI

rank = MPI.COMM_WORLD.Get_rank()
torch.cuda.set_device(0)
store = dist.TCPStore("127.0.0.1", 29511, 2, is_master=rank == 0)
try:
    dist.init_process_group("nccl", store=store, rank=rank, world_size=2,
                            device_id=torch.device("cuda:0"))
    x = torch.full((4,), float(rank + 1), device="cuda:0")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    print(f"rank {rank}: allreduce gave {x.tolist()}", flush=True)
except Exception as error:  # what NCCL says is the point here
    print(f"rank {rank}: {type(error).__name__}: {str(error)[:600]}", flush=True)
EOF
NCCL_DEBUG=WARN timeout 90 "${MPIEXEC[@]}" -n 2 $PY /tmp/nccl_two_ranks_one_gpu.py 2>&1 | tail -20
echo "exit ${PIPESTATUS[0]}"

fi

if wanted throughput; then
step "learner throughput, CPU (every core) and GPU"
timeout 400 $PY benchmarks/learner_throughput.py ${THROUGHPUT_ARGS:-} \
    --json "$OUT/learner_throughput.json"
fi

if wanted cartpole; then

step "CartPole end to end: the learner on the GPU, then on the CPU (driver, learner, 2 rollout)"
for algo in PPO IMPALA; do
    stop='{"episode_return_mean": 450, "timesteps_total": 200000}'
    [ $algo = IMPALA ] && stop='{"timesteps_total": 300000}'
    for where in gpu cpu; do
        visible=$([ $where = cpu ] && echo "" || echo 0)
        echo "--- $algo, learner on the $where"
        CUDA_VISIBLE_DEVICES=$visible timeout 240 "${MPIEXEC[@]}" -n 4 $PY -m mpirl train \
            --algo $algo --env CartPole-v1 --config '{"num_learners": 1}' \
            --run-dir "/tmp/run-$algo-$where" --stop "$stop" > "/tmp/run-$algo-$where.log" 2>&1
        echo "exit $?"
        grep -E "^[0-9]+ +learner" "/tmp/run-$algo-$where.log"
        tail -2 "/tmp/run-$algo-$where.log"
    done
done
fi
step done
