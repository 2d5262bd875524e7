// Instance log: opens at the tail, follows new lines, pauses while the reader scrolls up, filters.
(function () {
  function setup() {
    var log = document.getElementById("log");
    if (!log) return;
    var filter = document.getElementById("log-filter");
    var status = document.getElementById("log-follow");
    var follow = true;
    function atBottom() { return log.scrollHeight - log.scrollTop - log.clientHeight < 24; }
    function apply(line) {
      var q = filter && filter.value.toLowerCase();
      line.style.display = q && line.textContent.toLowerCase().indexOf(q) === -1 ? "none" : "";
    }
    log.scrollTop = log.scrollHeight;
    log.addEventListener("scroll", function () {
      follow = atBottom();
      if (status) status.textContent = follow ? "following" : "paused (scroll to the end to follow)";
    });
    new MutationObserver(function (records) {
      records.forEach(function (r) { r.addedNodes.forEach(function (n) { if (n.nodeType === 1) apply(n); }); });
      var lines = log.querySelectorAll(".line");
      for (var i = 0; i < lines.length - 5000; i++) lines[i].remove();  // bound the page's memory
      if (follow) log.scrollTop = log.scrollHeight;
    }).observe(log, { childList: true });
    if (filter) filter.addEventListener("input", function () { log.querySelectorAll(".line").forEach(apply); });
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", setup); else setup();
})();
