// Live-update indicator for pages with an htmx websocket: shows connected / reconnecting.
(function () {
  function indicator() { return document.getElementById("live-indicator"); }
  document.addEventListener("htmx:wsOpen", function () {
    var el = indicator(); if (el) { el.hidden = false; el.classList.remove("down"); el.textContent = "● live"; }
  });
  document.addEventListener("htmx:wsClose", function () {
    var el = indicator(); if (el) { el.hidden = false; el.classList.add("down"); el.textContent = "● reconnecting"; }
  });
  // Pause websocket-driven DOM work while the tab is hidden; when it shows again, pages that
  // missed fragments re-fetch their live parts (elements with hx-trigger="live:resync from:body").
  var missed = false;
  document.addEventListener("htmx:wsBeforeMessage", function (evt) {
    if (document.hidden) { evt.preventDefault(); missed = true; }
  });
  document.addEventListener("visibilitychange", function () {
    if (!document.hidden && missed) {
      missed = false;
      document.body.dispatchEvent(new CustomEvent("live:resync", { bubbles: true }));
    }
  });
})();
