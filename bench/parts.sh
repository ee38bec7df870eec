# Sourced by the one-call device scripts (bench/*_run.sh): run parts under a shared time budget.
#   needs OUT (the folder whose files come back), BUDGET (s after set-up), T0 (=$SECONDS then),
#   R (the results folder, packed into $OUT/$PACK), RESERVE (s kept for the last pack)
# A hang or a slow compile costs its own part and nothing after it; steps.txt says what each returned.

pack() { tar -C "$OUT" -czf "$OUT/$PACK.new" "$(basename "$R")" && mv "$OUT/$PACK.new" "$OUT/$PACK"; }

# part NAME WANT CMD...: CMD under `timeout`, capped at WANT s and at the budget left (less RESERVE)
part() {
  local name=$1 want=$2; shift 2
  local left=$(( BUDGET - (SECONDS - T0) - RESERVE ))
  local cap=$(( want < left ? want : left ))
  if (( cap < 15 )); then echo "== $name: skipped, $left s of the budget left" | tee -a "$OUT/steps.txt"; return 0; fi
  local t=$SECONDS
  echo "== $name: start at $((SECONDS - T0)) s, cap $cap s" | tee -a "$OUT/steps.txt"
  timeout -k 5 "$cap" "$@"
  echo "== $name: rc $? in $((SECONDS - t)) s" | tee -a "$OUT/steps.txt"
}

# save_fla_configs: what fla tuned in this call, added to the checked-in configs, into $R/fla_configs
# (commit them as bench/fla_configs/<GPU>/ so the next cold machine skips that tuning)
save_fla_configs() {
  [ -n "${FLA_GPU:-}" ] || return 0
  mkdir -p "$R/fla_configs"
  [ -d "bench/fla_configs/$FLA_GPU" ] && cp -r "bench/fla_configs/$FLA_GPU" "$R/fla_configs/"
  python bench/fla_configs.py --out "$R/fla_configs/$FLA_GPU" 2>&1 | tail -1 | tee -a "$OUT/steps.txt"
}
