# Sourced by the CPU demo scripts that pass their own arguments on to the engine ("$@"):
#   demo_arg KEY DEFAULT "$@"   prints the value of the last KEY=VALUE argument, else DEFAULT,
# so a demo prints (and converts) the folders a run really used, e.g. logging.dir=... given on
# its command line. Hydra's last override wins; so does this.
demo_arg() {
  local key=$1 value=$2 arg
  shift 2
  for arg in "$@"; do
    case "$arg" in
      "$key="*) value=${arg#"$key="} ;;
    esac
  done
  printf '%s\n' "$value"
}
