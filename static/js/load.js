// The Load page: "Add" beside an adapter in the store appends its line (name lora/<name> 1.0) to
// the LoRA adapters field; the input event asks for the verdict again.
(function () {
  document.addEventListener("click", function (evt) {
    var button = evt.target.closest ? evt.target.closest("button.add-adapter") : null;
    if (!button) { return; }
    var field = document.getElementById("id_adapters");
    if (!field) { return; }
    var line = button.getAttribute("data-line") || "";
    var lines = field.value.split("\n").filter(function (l) { return l.trim() !== ""; });
    if (lines.indexOf(line) === -1) { lines.push(line); }
    field.value = lines.join("\n") + "\n";
    field.dispatchEvent(new Event("input", { bubbles: true }));
    field.focus();
  });
})();
