// outbox web: the live parts of a page. An element with data-refresh="URL" is read again every
// data-every seconds and its content swapped in place, without a reload; a failed read keeps
// what is shown and marks it stale. No build step, no library: this is the whole script.
"use strict";
for (const el of document.querySelectorAll("[data-refresh]")) {
  const every = Math.max(1, Number(el.dataset.every || 2)) * 1000;
  const refresh = async () => {
    try {
      const answer = await fetch(el.dataset.refresh, { credentials: "same-origin" });
      if (!answer.ok) throw new Error(String(answer.status));
      el.innerHTML = await answer.text();
      el.classList.remove("stale");
    } catch (_) {
      el.classList.add("stale");
    }
    // A finished job stops asking.
    if (!el.querySelector('[data-state="finished"], [data-state="stopped"]')) {
      setTimeout(refresh, every);
    }
  };
  setTimeout(refresh, every);
}
