# Sourced by scripts that run several jobs side by side on a host of several GPUs (after common.sh):
#   lane GPU NAME CMD...   CMD in the background on GPU (CUDA_VISIBLE_DEVICES) and that GPU's share of the CPU
#                          cores (taskset: host cores / GPUs, so a lane has what a one-GPU machine has), with
#                          OUT=$OUT/NAME; its output in $OUT/NAME/lane.txt
#   lanes_report [N]       the last N lines of every lane's output
#   pack_out NAME          everything under $OUT into $OUT/NAME.tgz (a call brings back at most 8 files)
lane() {
  local gpu=$1 name=$2 gpus cores per first
  shift 2
  gpus=$(nvidia-smi -L | wc -l) cores=$(nproc)
  [ "$gpus" -gt 0 ] || gpus=1
  per=$((cores / gpus)) first=$((gpu * cores / gpus))
  mkdir -p "$out/$name"
  (export CUDA_VISIBLE_DEVICES=$gpu OUT=$out/$name
    exec taskset -c "$first-$((first + per - 1))" "$@") > "$out/$name/lane.txt" 2>&1 &
  echo "lane $name: GPU $gpu, cores $first-$((first + per - 1)): $* (pid $!)"
}

lanes_report() {
  local f
  for f in "$out"/*/lane.txt; do echo "=== ${f#"$out"/}"; tail -n "${1:-20}" "$f" | cut -c1-600; done
}

pack_out() {
  (cd "$out" && tar czf "/tmp/$1.tgz" --exclude "*.tgz" . && find . -mindepth 1 -not -name "*.tgz" -delete)
  mv "/tmp/$1.tgz" "$out/$1.tgz" && echo "packed $out/$1.tgz ($(du -h "$out/$1.tgz" | cut -f1))"
}
