// Live fragments carry data-version; an older one (a catch-up fetch that raced a websocket
// update) never overwrites a newer one. After a swap the target remembers the newest version.
(function () {
  function versionOf(el) { var v = el && el.getAttribute && el.getAttribute("data-version"); return v ? Number(v) : null; }
  function fragmentElement(detail) {
    var f = detail.fragment;
    return f && f.nodeType === 11 ? f.firstElementChild : f;
  }
  document.addEventListener("htmx:oobBeforeSwap", function (evt) {
    var incoming = versionOf(fragmentElement(evt.detail));
    var current = versionOf(evt.detail.target);
    if (incoming !== null && current !== null && incoming < current) evt.detail.shouldSwap = false;
    evt.detail.target._incomingVersion = incoming;
  });
  document.addEventListener("htmx:oobAfterSwap", function (evt) {
    var target = evt.detail.target;
    var incoming = target && target._incomingVersion;
    if (incoming === null || incoming === undefined) return;
    // An outerHTML swap replaced the node: find it again by id.
    var live = (target.id && document.getElementById(target.id)) || target;
    if ((versionOf(live) || 0) < incoming) live.setAttribute("data-version", String(incoming));
    var parentBody = live.closest && live.closest("tbody[data-version]");
    if (parentBody && parentBody !== live && (versionOf(parentBody) || 0) < incoming) {
      parentBody.setAttribute("data-version", String(incoming));
    }
  });
})();
