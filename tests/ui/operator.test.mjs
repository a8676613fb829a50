// The operator page end to end: a real `palisade serve`, real HTTP writes,
// the page in headless Chromium. It must show a write live (over SSE) and
// count a stale rejection.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { createServer } from "node:http";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";
import { createInterface } from "node:readline";
import { chromium } from "playwright-core";

const root = resolve(import.meta.dirname, "../..");
const bin = process.env.PALISADE_BIN ?? join(root, "target/debug/palisade");
const chromiumPath = process.env.CHROMIUM ?? "/usr/bin/chromium";
let server, base, dir, browser;

before(async () => {
  dir = mkdtempSync(join(tmpdir(), "palisade-ui-"));
  // Fast outbox retries: a failing effect is dead after two quick tries.
  const outbox = ["--outbox-backoff-ms", "5", "--outbox-backoff-max-ms", "20", "--outbox-max-attempts", "2"];
  server = spawn(bin, ["serve", "--data", dir, "--listen", "127.0.0.1:0", ...outbox], { stdio: ["ignore", "pipe", "inherit"] });
  const lines = createInterface({ input: server.stdout });
  base = await new Promise((ok, fail) => {
    server.once("exit", (c) => fail(new Error(`palisade serve exited with ${c}`)));
    lines.once("line", (l) => ok(l.replace("palisade listening on ", "").trim()));
  });
  browser = await chromium.launch({
    executablePath: chromiumPath,
    args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync"],
  });
});

after(async () => {
  await browser?.close();
  server?.kill("SIGTERM");
  if (dir) rmSync(dir, { recursive: true, force: true });
});

async function api(method, path, body, headers = {}) {
  const r = await fetch(base + path, { method, headers: { "content-type": "application/json", ...headers }, body: body && JSON.stringify(body) });
  return { status: r.status, body: r.status === 204 ? null : await r.json() };
}
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

test("a write appears live and a stale rejection is counted", async () => {
  const a = await api("POST", "/v1/leases", { scope: "twin/ui-pump", holder: "A", ttl_ms: 300 });
  assert.equal(a.status, 201);
  const w1 = await api("POST", "/v1/twins/ui-pump/events", { type: "set", patch: { rpm: 100 } }, { "fencing-token": String(a.body.token) });
  assert.equal(w1.status, 201);

  const page = await browser.newPage();
  const errors = [];
  page.on("pageerror", (e) => errors.push(e));
  await page.goto(base + "/");
  await page.fill("#twin-id", "ui-pump");
  await page.click("#twin-form button");
  await page.waitForSelector("#twin-state");
  assert.match(await page.textContent("#twin-state"), /"rpm": 100/);

  // Live: a write made after the page subscribed shows up without reload.
  const w2 = await api("POST", "/v1/twins/ui-pump/events", { type: "set", patch: { rpm: 250 } }, { "fencing-token": String(a.body.token) });
  assert.equal(w2.status, 201);
  await page.waitForFunction(() => [...document.querySelectorAll("#live li.event")].some((li) => li.textContent.includes('"rpm":250')), null, { timeout: 10000 });
  await page.waitForFunction(() => document.querySelector("#twin-state")?.textContent.includes('"rpm": 250'), null, { timeout: 10000 });

  // A pauses past its lease, B takes over, A's late write is refused and counted.
  await sleep(400);
  const b = await api("POST", "/v1/leases", { scope: "twin/ui-pump", holder: "B", ttl_ms: 5000 });
  assert.equal(b.status, 201);
  const stale = await api("POST", "/v1/twins/ui-pump/events", { type: "set", patch: { rpm: 0 } }, { "fencing-token": String(a.body.token) });
  assert.equal(stale.status, 409);
  await page.waitForFunction(() => Number(document.querySelector("#stale-count").textContent) >= 1, null, { timeout: 10000 });
  assert.match(await page.textContent("#rejections"), /stale_token/);
  // The twin's timeline shows who wrote what under which token, and the refused attempt.
  await page.waitForFunction(() => [...document.querySelectorAll("#timeline li.refused")].some((li) => li.textContent.includes("stale_token")), null, { timeout: 10000 });
  const written = await page.locator("#timeline li.written").allTextContents();
  assert.equal(written.length, 2, String(written));
  assert.ok(written.every((t) => t.includes("A wrote") && t.includes(`under token ${a.body.token}`)), String(written));
  assert.match(await page.textContent("#timeline li.refused"), new RegExp(`token ${a.body.token}`));
  // From the twin's durable refusal journal (issue 14): the fence it hit,
  // the holder of the refused token, the payload digest.
  assert.match(await page.textContent("#timeline li.refused"), new RegExp(`fence ${b.body.token}\\) held by A`));
  assert.match(await page.textContent("#timeline li.refused"), /sha256 [0-9a-f]{12}/);

  // Live charts, from the store's own /metrics: the writes and the refusal
  // show as points above the baseline, latency has its two lines, and there
  // is no Kafka lag without Kafka.
  const peak = (sel) => page.evaluate((sel) => {
    const ys = [...document.querySelectorAll(sel)].flatMap((l) => (l.getAttribute("points") || "").trim().split(" ").filter(Boolean).map((p) => Number(p.split(",")[1])));
    return ys.length ? Math.min(...ys) : null;
  }, sel);
  await page.waitForFunction(() => document.querySelectorAll('#chart-refusals polyline[data-series="stale_token"]').length === 1, null, { timeout: 10000 });
  assert.ok((await peak("#chart-appends polyline")) < 80, "appends chart stays flat");
  assert.ok((await peak('#chart-refusals polyline[data-series="stale_token"]')) < 80, "refusal chart stays flat");
  assert.equal(await page.locator("#chart-latency polyline").count(), 2);
  assert.ok((await peak("#chart-latency polyline")) < 88, "latency chart stays at 0");
  assert.match(await page.textContent("#chart-lag .legend"), /no Kafka ingestion/);
  // What the start-up replay did (a fresh store: nothing to replay).
  await page.waitForFunction(() => /^0 rounds in \d+\.\d\d s$/.test(document.querySelector("#replay").textContent), null, { timeout: 10000 });
  // The partitions table lists every partition, with each owner lease's
  // purpose (decision 0028).
  assert.equal(await page.locator("#partitions tbody tr").count(), 16);
  const eff = await api("POST", "/v1/leases", { scope: "partition/5", holder: "batcher", ttl_ms: 60000, purpose: "efficiency" });
  assert.equal(eff.status, 201);
  assert.equal(eff.body.purpose, "efficiency");
  await page.waitForFunction(() => /batcher\s*efficiency/.test(document.querySelector("#partitions tbody tr:nth-child(6)")?.textContent ?? ""), null, { timeout: 10000 });
  await page.screenshot({ path: join(root, "target", "operator-page.png"), fullPage: true });
  assert.deepEqual(errors, []);
});

test("the outbox shows its counts and each dead effect with its error", async () => {
  // A receiver that confirms, and a URL nothing listens on (refused).
  const receiver = createServer((req, res) => { req.resume(); req.on("end", () => res.end("ok")); });
  await new Promise((ok) => receiver.listen(0, "127.0.0.1", ok));
  const okUrl = `http://127.0.0.1:${receiver.address().port}/hook`;
  const deadUrl = "http://127.0.0.1:1/unreachable";
  const l = await api("POST", "/v1/leases", { scope: "twin/ui-valve", holder: "W", ttl_ms: 60000 });
  assert.equal(l.status, 201);
  const hook = (url) => ({ kind: "webhook", url, body: { close: true } });
  const w = await api("POST", "/v1/twins/ui-valve/events", [
    { type: "cmd", patch: { v: 1 }, event_id: "ui-ok", effects: [hook(okUrl)] },
    { type: "cmd", patch: { v: 2 }, event_id: "ui-dead", effects: [hook(deadUrl)] },
  ], { "fencing-token": String(l.body.token) });
  assert.equal(w.status, 201);

  const page = await browser.newPage();
  const errors = [];
  page.on("pageerror", (e) => errors.push(e));
  await page.goto(base + "/");
  await page.waitForFunction(() => document.querySelector("#outbox-dead")?.textContent === "1", null, { timeout: 15000 });
  assert.equal(await page.textContent("#outbox-pending"), "0");
  assert.match(await page.textContent("#outbox-counts"), /0 pending, 1 delivered kept, 1 dead/);
  const row = await page.locator("#outbox-dead-list tbody tr").allTextContents();
  assert.equal(row.length, 1, String(row));
  assert.ok(row[0].includes("ui-dead:0") && row[0].includes("ui-valve") && row[0].includes(deadUrl), row[0]);
  // Two tries, and the client's error (a refused connection).
  const cells = await page.locator("#outbox-dead-list tbody tr td").allTextContents();
  assert.equal(cells[3], "2", String(cells));
  assert.ok(cells[4].length > 0, "the last error is shown");
  await page.screenshot({ path: join(root, "target", "operator-page-outbox.png"), fullPage: true });
  assert.deepEqual(errors, []);
  receiver.close();
});
