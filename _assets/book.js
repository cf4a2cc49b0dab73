// icl_book: click a figure to see it at its full size; click or Esc closes it.
(function () {
  function close() { var b = document.getElementById('icl-lightbox'); if (b) b.remove(); }
  function open(img) {
    close();
    var box = document.createElement('div'); box.id = 'icl-lightbox';
    box.setAttribute('role', 'dialog'); box.setAttribute('aria-label', 'figure at full size');
    var big = document.createElement('img'); big.src = img.currentSrc || img.src; big.alt = img.alt || '';
    box.appendChild(big); box.addEventListener('click', close);
    document.body.appendChild(box);
  }
  document.addEventListener('keydown', function (e) { if (e.key === 'Escape') close(); });
  document.addEventListener('click', function (e) {
    var t = e.target;
    if (t && t.tagName === 'IMG' && t.closest('.bd-article') && !t.closest('#icl-lightbox')
        && !t.closest('a') && (t.closest('figure') || t.closest('.cell_output'))) { open(t); }
  });
})();
