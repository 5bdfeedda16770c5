// A small Markdown renderer for model output that cannot inject HTML or script.
//
// It never builds an HTML string: it parses the text itself and creates DOM nodes, and every piece of
// the model's text goes into the page as a text node (textContent), so `<script>`, `<img onerror>` or an
// entity is shown as the characters it is. Links become <a> only for http(s) and mailto URLs (no
// `javascript:` or `data:`), open in a new tab without a referrer; images are shown as links, so a
// reply cannot make the browser fetch anything. The page's Content-Security-Policy is a second wall.
//
// Covered: paragraphs and line breaks, headings, fenced code (with a copy button), block quotes,
// ordered and unordered lists (nested by indentation), GFM tables, rules, and inline code, bold,
// italic, strikethrough, links, bare URLs and backslash escapes. Unclosed fences render as code, so a
// reply still streaming in looks right.

const SAFE_URL = /^(https?:|mailto:)/i;

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)/;
const HEADING = /^ {0,3}(#{1,6})(?:\s+(.*?))?(?:\s+#+)?\s*$/;
const RULE = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}> ?(.*)$/;
const LIST_ITEM = /^( *)([-*+]|\d{1,9}[.)])(?:\s+(.*)|$)/;
const TABLE_SEP = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;
const BLANK = /^\s*$/;

function el(tag, className) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  return node;
}

export function renderMarkdown(source) {
  const fragment = document.createDocumentFragment();
  renderBlocks(String(source).replace(/\r\n?/g, "\n").split("\n"), fragment);
  return fragment;
}

function startsBlock(line) {
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) || LIST_ITEM.test(line);
}

function renderBlocks(lines, parent) {
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if (BLANK.test(line)) {
      i++;
    } else if ((m = FENCE.exec(line))) {
      const close = new RegExp(`^ {0,3}${m[1][0] === "`" ? "`" : "~"}{${m[1].length},}\\s*$`);
      const body = [];
      for (i++; i < lines.length && !close.test(lines[i]); i++) body.push(lines[i]);
      i++; // the closing fence, if it has arrived
      parent.append(codeBlock(body.join("\n"), m[2]));
    } else if ((m = HEADING.exec(line))) {
      const h = el(`h${m[1].length}`);
      appendInline(h, m[2] || "");
      parent.append(h);
      i++;
    } else if (RULE.test(line)) {
      parent.append(el("hr"));
      i++;
    } else if (QUOTE.test(line)) {
      const inner = [];
      while (i < lines.length && (m = QUOTE.exec(lines[i]))) {
        inner.push(m[1]);
        i++;
      }
      const quote = el("blockquote");
      renderBlocks(inner, quote);
      parent.append(quote);
    } else if (LIST_ITEM.test(line)) {
      i = renderList(lines, i, parent);
    } else if (line.includes("|") && i + 1 < lines.length && TABLE_SEP.test(lines[i + 1]) && lines[i + 1].includes("-")) {
      i = renderTable(lines, i, parent);
    } else {
      const para = [line];
      for (i++; i < lines.length && !BLANK.test(lines[i]) && !startsBlock(lines[i]); i++) para.push(lines[i]);
      const p = el("p");
      appendInline(p, para.join("\n"));
      parent.append(p);
    }
  }
}

function codeBlock(text, lang) {
  const wrap = el("div", "code-block");
  const head = el("div", "code-head");
  const label = el("span");
  label.textContent = lang || "code";
  const copy = el("button");
  copy.type = "button";
  copy.textContent = "Copy";
  copy.setAttribute("aria-label", "Copy code");
  copy.addEventListener("click", async () => {
    try {
      await navigator.clipboard.writeText(text);
      copy.textContent = "Copied";
    } catch {
      copy.textContent = "Select and copy";
    }
    setTimeout(() => (copy.textContent = "Copy"), 1500);
  });
  head.append(label, copy);
  const pre = el("pre");
  const code = el("code");
  if (lang) code.dataset.lang = lang;
  code.textContent = text;
  pre.append(code);
  wrap.append(head, pre);
  return wrap;
}

function renderList(lines, i, parent) {
  const first = LIST_ITEM.exec(lines[i]);
  const indent = first[1].length;
  const ordered = /\d/.test(first[2]);
  const list = el(ordered ? "ol" : "ul");
  if (ordered) {
    const start = parseInt(first[2], 10);
    if (start !== 1) list.start = start;
  }
  const items = []; // the lines of each item, its marker and the marker's indentation taken off
  let contentIndent = 0;
  while (i < lines.length) {
    const line = lines[i];
    const m = LIST_ITEM.exec(line);
    if (m && m[1].length <= indent + 1) {
      if (/\d/.test(m[2]) !== ordered) break; // a list of the other kind starts
      items.push([m[3] || ""]);
      contentIndent = m[1].length + m[2].length + 1;
      i++;
      continue;
    }
    const item = items[items.length - 1];
    const lead = line.match(/^ */)[0].length;
    if (BLANK.test(line)) {
      // A blank line continues the list only if the next non-blank line belongs to it.
      let j = i + 1;
      while (j < lines.length && BLANK.test(lines[j])) j++;
      if (j === lines.length) break;
      const nextItem = LIST_ITEM.exec(lines[j]);
      const nextLead = lines[j].match(/^ */)[0].length;
      if (!(nextLead > indent || (nextItem && nextItem[1].length <= indent + 1))) break;
      item.push("");
    } else if (lead > indent) {
      item.push(line.slice(Math.min(lead, contentIndent)));
    } else if (!startsBlock(line)) {
      item.push(line); // a lazy continuation of the item's paragraph
    } else {
      break;
    }
    i++;
  }
  for (const itemLines of items) {
    const li = el("li");
    // A one-paragraph item renders inline (a tight list); anything more gets blocks.
    if (itemLines.some((l, k) => k > 0 && (BLANK.test(l) || startsBlock(l)))) renderBlocks(itemLines, li);
    else appendInline(li, itemLines.join("\n"));
    list.append(li);
  }
  parent.append(list);
  return i;
}

function splitRow(line) {
  let row = line.trim();
  if (row.startsWith("|")) row = row.slice(1);
  if (row.endsWith("|") && !row.endsWith("\\|")) row = row.slice(0, -1);
  return row.split(/(?<!\\)\|/).map((cell) => cell.trim().replace(/\\\|/g, "|"));
}

function renderTable(lines, i, parent) {
  const header = splitRow(lines[i]);
  const aligns = splitRow(lines[i + 1]).map((c) =>
    c.startsWith(":") && c.endsWith(":") ? "center" : c.endsWith(":") ? "right" : c.startsWith(":") ? "left" : "",
  );
  const table = el("table");
  const thead = el("thead");
  const headRow = el("tr");
  header.forEach((text, k) => headRow.append(cell("th", text, aligns[k])));
  thead.append(headRow);
  const tbody = el("tbody");
  for (i += 2; i < lines.length && !BLANK.test(lines[i]) && lines[i].includes("|"); i++) {
    const row = el("tr");
    const cells = splitRow(lines[i]);
    header.forEach((_, k) => row.append(cell("td", cells[k] || "", aligns[k])));
    tbody.append(row);
  }
  table.append(thead, tbody);
  parent.append(table);
  return i;
}

function cell(tag, text, align) {
  const node = el(tag);
  if (align) node.style.textAlign = align; // CSSOM, which the page's CSP allows (style attributes it does not)
  appendInline(node, text);
  return node;
}

// ---- inline ----------------------------------------------------------------------------------------

// One alternation, tried left to right; the earliest match wins. Groups:
// 1 escaped char | 2,3 code span | 4 **bold** | 5 __bold__ | 6 ~~strike~~ | 7 *em* | 8 _em_ |
// 9 "!" of an image, 10 link text, 11 link URL | 12 bare URL | 13 line break
const INLINE = new RegExp(
  [
    String.raw`\\([!-/:-@[-\`{-~])`,
    String.raw`(\`+)([^\`]|[^\`][\s\S]*?[^\`])\2(?!\`)`,
    String.raw`\*\*(?=\S)([\s\S]*?\S)\*\*`,
    String.raw`(?<!\w)__(?=\S)([\s\S]*?\S)__(?!\w)`,
    String.raw`~~(?=\S)([\s\S]*?\S)~~`,
    String.raw`\*([^\s*](?:[\s\S]*?[^\s*])?)\*(?!\*)`,
    String.raw`(?<![\w\\])_([^\s_](?:[\s\S]*?[^\s_])?)_(?!\w)`,
    String.raw`(!?)\[([^\]\n]*)\]\(\s*<?([^\s<>()]*(?:\([^\s<>()]*\)[^\s<>()]*)*)>?(?:\s+"[^"\n]*")?\s*\)`,
    String.raw`(https?:\/\/[^\s<>"'\`]*[^\s<>"'\`.,:;!?)\]*_~])`,
    String.raw`(\n)`,
  ].join("|"),
);

function safeHref(url) {
  if (!SAFE_URL.test(url)) return null;
  try {
    const parsed = new URL(url);
    return ["http:", "https:", "mailto:"].includes(parsed.protocol) ? parsed.href : null;
  } catch {
    return null;
  }
}

function link(href, children) {
  const a = el("a");
  a.href = href;
  a.target = "_blank";
  a.rel = "noopener noreferrer nofollow";
  a.append(...children);
  return a;
}

function appendInline(parent, text, inLink = false) {
  let rest = text;
  while (rest) {
    const m = INLINE.exec(rest);
    if (!m) break;
    if (m.index) parent.append(document.createTextNode(rest.slice(0, m.index)));
    rest = rest.slice(m.index + m[0].length);
    parent.append(...inlineNodes(m, inLink));
  }
  if (rest) parent.append(document.createTextNode(rest));
}

function inlineNodes(m, inLink) {
  const wrap = (tag, inner) => {
    const node = el(tag);
    appendInline(node, inner, inLink);
    return [node];
  };
  if (m[1] !== undefined) return [document.createTextNode(m[1])];
  if (m[2] !== undefined) {
    const code = el("code");
    code.textContent = m[3].length > 2 && m[3].startsWith(" ") && m[3].endsWith(" ") ? m[3].slice(1, -1) : m[3];
    return [code];
  }
  if (m[4] !== undefined) return wrap("strong", m[4]);
  if (m[5] !== undefined) return wrap("strong", m[5]);
  if (m[6] !== undefined) return wrap("del", m[6]);
  if (m[7] !== undefined) return wrap("em", m[7]);
  if (m[8] !== undefined) return wrap("em", m[8]);
  if (m[10] !== undefined) {
    const href = inLink ? null : safeHref(m[11]);
    if (!href) return [document.createTextNode(m[0])];
    const label = el("span");
    appendInline(label, m[10] || m[11], true);
    if (m[9]) label.prepend(document.createTextNode("image: "));
    return [link(href, [...label.childNodes])];
  }
  if (m[12] !== undefined) {
    const href = inLink ? null : safeHref(m[12]);
    return href ? [link(href, [document.createTextNode(m[12])])] : [document.createTextNode(m[12])];
  }
  return [el("br")];
}
