#!/usr/bin/env bash
# Put MathJax and the ipywidgets HTML manager into _vendor/ so the book renders
# math and widgets offline. Pinned packages come from the npm registry; where
# npm or the registry is unavailable, small loader shims fall back to the CDN.
set -euo pipefail
cd "$(dirname "$0")/.."
out=_vendor
[ -f "$out/.complete" ] && { echo "vendor: $out already complete"; exit 0; }
rm -rf "$out"; mkdir -p "$out/mathjax"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
fetch() {  # fetch NAME@VERSION -> unpacked into $tmp/NAME
  local spec=$1 dir=$tmp/$2
  mkdir -p "$dir" && (cd "$dir" && npm pack --silent "$spec" >/dev/null 2>&1) \
    && tar -xzf "$dir"/*.tgz -C "$dir"
}
if command -v npm >/dev/null && fetch mathjax@3.2.2 mj \
   && fetch @jupyter-widgets/html-manager@1.0.6 hm && fetch requirejs@2.3.4 rq; then
  cp -r "$tmp/mj/package/es5/." "$out/mathjax/"
  cp "$tmp/hm/package/dist/embed-amd.js" "$out/embed-amd.js"
  cp "$tmp/rq/package/require.js" "$out/require.js"
  echo "vendor: MathJax 3.2.2, html-manager 1.0.6, requirejs 2.3.4 from npm"
  touch "$out/.complete"
else
  cdn=https://cdn.jsdelivr.net/npm
  shim() { printf 'document.write(%s);\n' "'<script src=\"$1\"></script>'" > "$2"; }
  # MathJax is loaded with defer, where document.write is ignored: append instead
  printf '%s\n' "var s = document.createElement('script');" \
    "s.src = '$cdn/mathjax@3.2.2/es5/tex-chtml.js'; document.head.appendChild(s);" \
    > "$out/mathjax/tex-chtml.js"
  shim "$cdn/requirejs@2.3.4/require.js" "$out/require.js"
  shim "$cdn/@jupyter-widgets/html-manager@1.0.6/dist/embed-amd.js" "$out/embed-amd.js"
  echo "vendor: npm unavailable, using CDN loader shims (math needs a network)"
fi
