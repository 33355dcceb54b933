# Shared by the build scripts (source it): helpers that must behave the same in every recipe.

# drafter_from_git COMMIT DIR [HINT]: write the default drafter of git commit COMMIT (config.json,
# model.safetensors, training.json of the packaged asset) into DIR. Each file goes through a .tmp,
# so an interrupted or failed read never leaves a file that a rerun would take as complete; HINT is
# added to the error (e.g. another way to give the drafter).
drafter_from_git() {
  local commit=$1 dir=$2 hint=${3:-} asset=dflash_trt/assets/smollm2-135m-instruct-dflash-b16 f
  mkdir -p "$dir"
  for f in config.json model.safetensors training.json; do
    [ -s "$dir/$f" ] && continue
    git show "$commit:$asset/$f" > "$dir/$f.tmp" || {
      echo "error: cannot read $asset/$f of commit $commit from git: this needs a full clone with that" \
        "commit (a shallow one lacks it: git fetch --unshallow)$hint" >&2
      rm -f "$dir/$f.tmp"; return 1; }
    mv "$dir/$f.tmp" "$dir/$f"
  done
}
