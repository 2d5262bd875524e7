// Live-update indicator for pages with an htmx websocket: shows connected / reconnecting.
(function () {
  function indicator() { return document.getElementById("live-indicator"); }
  document.addEventListener("htmx:wsOpen", function () {
    var el = indicator(); if (el) { el.hidden = false; el.classList.remove("down"); el.textContent = "● live"; }
  });
  document.addEventListener("htmx:wsClose", function () {
    var el = indicator(); if (el) { el.hidden = false; el.classList.add("down"); el.textContent = "● reconnecting"; }
  });
  // Pause websocket-driven DOM work while the tab is hidden; the next fragment catches up.
  document.addEventListener("htmx:wsBeforeMessage", function (evt) {
    if (document.hidden) { evt.preventDefault(); }
  });
})();
