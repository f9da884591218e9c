// MathJax for pymdownx.arithmatex (generic mode): $...$ and $$...$$ in pages
// and docstrings.
window.MathJax = {
  tex: {
    inlineMath: [["\\(", "\\)"]],
    displayMath: [["\\[", "\\]"]],
    processEscapes: true,
    processEnvironments: true,
  },
  options: {
    ignoreHtmlClass: ".*|",
    processHtmlClass: "arithmatex",
  },
};

// mkdocs-material's page observable: typeset again when a page is swapped in
// (MathJax typesets the first page itself when it starts).
if (typeof document$ !== "undefined") {
  document$.subscribe(() => {
    if (MathJax.typesetPromise) MathJax.typesetPromise();
  });
}
