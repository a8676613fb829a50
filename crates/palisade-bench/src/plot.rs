//! A tiny SVG line-chart writer for the bench's plots (no plotting crate:
//! a few polylines, axes and a legend are all the report needs).

use std::fmt::Write as _;

const WIDTH: f64 = 760.0;
const HEIGHT: f64 = 440.0;
const LEFT: f64 = 84.0;
const RIGHT: f64 = 220.0;
const TOP: f64 = 44.0;
const BOTTOM: f64 = 62.0;
const COLORS: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
];

/// One line of a chart.
#[derive(Debug, Clone)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
    /// Draw a marker at every point (for sparse series).
    pub markers: bool,
}

impl Series {
    pub fn new(name: impl Into<String>, points: Vec<(f64, f64)>, markers: bool) -> Self {
        Self {
            name: name.into(),
            points,
            markers,
        }
    }
}

/// A line chart.
#[derive(Debug, Clone, Default)]
pub struct Chart {
    pub title: String,
    pub subtitle: String,
    pub x_label: String,
    pub y_label: String,
    pub x_log: bool,
    pub y_log: bool,
    /// Put x ticks exactly at these values (e.g. the partition counts).
    pub x_ticks: Option<Vec<f64>>,
    pub series: Vec<Series>,
}

#[derive(Debug, Clone, Copy)]
struct Axis {
    lo: f64,
    hi: f64,
    log: bool,
}

impl Axis {
    fn fit(values: impl Iterator<Item = f64>, log: bool, from_zero: bool) -> Self {
        let mut lo = f64::INFINITY;
        let mut hi = f64::NEG_INFINITY;
        for v in values.filter(|v| v.is_finite() && (!log || *v > 0.0)) {
            lo = lo.min(v);
            hi = hi.max(v);
        }
        if !lo.is_finite() {
            (lo, hi) = if log { (1.0, 10.0) } else { (0.0, 1.0) };
        }
        if log {
            lo = 10f64.powf(lo.log10().floor());
            hi = 10f64.powf(hi.log10().ceil());
            if hi <= lo {
                hi = lo * 10.0;
            }
        } else {
            if from_zero && lo > 0.0 {
                lo = 0.0;
            }
            if hi <= lo {
                hi = lo + 1.0;
            }
            let step = nice_step((hi - lo) / 5.0);
            lo = (lo / step).floor() * step;
            hi = (hi / step).ceil() * step;
        }
        Self { lo, hi, log }
    }

    /// 0..1 along the axis.
    fn frac(&self, v: f64) -> f64 {
        if self.log {
            (v.max(self.lo).log10() - self.lo.log10()) / (self.hi.log10() - self.lo.log10())
        } else {
            (v - self.lo) / (self.hi - self.lo)
        }
    }

    fn ticks(&self) -> Vec<f64> {
        if self.log {
            let mut out = Vec::new();
            let decades = (self.hi.log10() - self.lo.log10()).round();
            let mut d = self.lo;
            while d <= self.hi * 1.0001 {
                out.push(d);
                if decades <= 2.0 {
                    for m in [2.0, 5.0] {
                        if d * m < self.hi {
                            out.push(d * m);
                        }
                    }
                }
                d *= 10.0;
            }
            out
        } else {
            let step = nice_step((self.hi - self.lo) / 5.0);
            let mut out = Vec::new();
            let mut v = self.lo;
            while v <= self.hi + step * 0.001 {
                out.push(v);
                v += step;
            }
            out
        }
    }
}

fn nice_step(raw: f64) -> f64 {
    if raw <= 0.0 || !raw.is_finite() {
        return 1.0;
    }
    let mag = 10f64.powf(raw.log10().floor());
    let n = raw / mag;
    let m = if n <= 1.0 {
        1.0
    } else if n <= 2.0 {
        2.0
    } else if n <= 5.0 {
        5.0
    } else {
        10.0
    };
    m * mag
}

/// `12000` -> `12k`, `0.25` -> `0.25`.
pub fn label(v: f64) -> String {
    let a = v.abs();
    let trim = |s: String| {
        if s.contains('.') {
            s.trim_end_matches('0').trim_end_matches('.').to_owned()
        } else {
            s
        }
    };
    if a >= 1e6 {
        format!("{}M", trim(format!("{:.2}", v / 1e6)))
    } else if a >= 1e3 {
        format!("{}k", trim(format!("{:.2}", v / 1e3)))
    } else if a >= 1.0 || a == 0.0 {
        trim(format!("{v:.2}"))
    } else {
        trim(format!("{v:.4}"))
    }
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

impl Chart {
    pub fn svg(&self) -> String {
        let xs = self
            .series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.0));
        let ys = self
            .series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.1));
        let mut xa = Axis::fit(xs, self.x_log, false);
        if let Some(t) = &self.x_ticks {
            if let (Some(lo), Some(hi)) = (
                t.iter().copied().reduce(f64::min),
                t.iter().copied().reduce(f64::max),
            ) {
                if hi > lo {
                    xa.lo = lo;
                    xa.hi = hi;
                }
            }
        }
        let ya = Axis::fit(ys, self.y_log, true);
        let pw = WIDTH - LEFT - RIGHT;
        let ph = HEIGHT - TOP - BOTTOM;
        let px = |v: f64| LEFT + xa.frac(v) * pw;
        let py = |v: f64| TOP + ph - ya.frac(v) * ph;

        let mut s = String::new();
        let _ = writeln!(
            s,
            r##"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">"##
        );
        let _ = writeln!(
            s,
            r##"<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>"##
        );
        let _ = writeln!(
            s,
            r##"<text x="{LEFT}" y="20" font-size="15" font-weight="bold">{}</text>"##,
            esc(&self.title)
        );
        if !self.subtitle.is_empty() {
            let _ = writeln!(
                s,
                r##"<text x="{LEFT}" y="36" font-size="11" fill="#555">{}</text>"##,
                esc(&self.subtitle)
            );
        }
        // Grid and ticks.
        let x_ticks = self.x_ticks.clone().unwrap_or_else(|| xa.ticks());
        for t in x_ticks.iter().filter(|t| **t >= xa.lo && **t <= xa.hi) {
            let x = px(*t);
            let _ = writeln!(
                s,
                r##"<line x1="{x:.1}" y1="{TOP}" x2="{x:.1}" y2="{:.1}" stroke="#e5e5e5"/><text x="{x:.1}" y="{:.1}" text-anchor="middle">{}</text>"##,
                TOP + ph,
                TOP + ph + 16.0,
                label(*t)
            );
        }
        for t in ya.ticks() {
            let y = py(t);
            let _ = writeln!(
                s,
                r##"<line x1="{LEFT}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#e5e5e5"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
                LEFT + pw,
                LEFT - 6.0,
                y + 4.0,
                label(t)
            );
        }
        let _ = writeln!(
            s,
            r##"<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" fill="none" stroke="#333"/>"##
        );
        let _ = writeln!(
            s,
            r##"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"##,
            LEFT + pw / 2.0,
            HEIGHT - 18.0,
            esc(&self.x_label)
        );
        let _ = writeln!(
            s,
            r##"<text transform="translate(18,{:.1}) rotate(-90)" text-anchor="middle">{}</text>"##,
            TOP + ph / 2.0,
            esc(&self.y_label)
        );
        // Series and legend.
        for (i, ser) in self.series.iter().enumerate() {
            let color = COLORS[i % COLORS.len()];
            let pts: Vec<String> = ser
                .points
                .iter()
                .filter(|(x, y)| {
                    x.is_finite()
                        && y.is_finite()
                        && (!self.x_log || *x > 0.0)
                        && (!self.y_log || *y > 0.0)
                })
                .map(|(x, y)| format!("{:.1},{:.1}", px(*x), py(*y)))
                .collect();
            if pts.len() > 1 {
                let _ = writeln!(
                    s,
                    r##"<polyline fill="none" stroke="{color}" stroke-width="2" points="{}"/>"##,
                    pts.join(" ")
                );
            }
            if ser.markers || pts.len() == 1 {
                for p in &pts {
                    if let Some((x, y)) = p.split_once(',') {
                        let _ =
                            writeln!(s, r##"<circle cx="{x}" cy="{y}" r="3.5" fill="{color}"/>"##);
                    }
                }
            }
            let ly = TOP + 10.0 + 20.0 * i as f64;
            let lx = LEFT + pw + 14.0;
            let _ = writeln!(
                s,
                r##"<line x1="{lx}" y1="{ly}" x2="{:.1}" y2="{ly}" stroke="{color}" stroke-width="3"/><text x="{:.1}" y="{:.1}">{}</text>"##,
                lx + 22.0,
                lx + 28.0,
                ly + 4.0,
                esc(&ser.name)
            );
        }
        s.push_str("</svg>\n");
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels() {
        assert_eq!(label(12_000.0), "12k");
        assert_eq!(label(1_500_000.0), "1.5M");
        assert_eq!(label(0.25), "0.25");
        assert_eq!(label(3.0), "3");
        assert_eq!(label(0.0), "0");
    }

    #[test]
    fn draws_a_chart() {
        let c = Chart {
            title: "t <1>".into(),
            x_label: "x".into(),
            y_label: "y".into(),
            x_log: true,
            x_ticks: Some(vec![1.0, 4.0, 16.0, 64.0]),
            series: vec![
                Series::new("a", vec![(1.0, 10.0), (4.0, 20.0), (64.0, 15.0)], true),
                Series::new("b", vec![(1.0, 5.0)], false),
            ],
            ..Chart::default()
        };
        let svg = c.svg();
        assert!(svg.starts_with("<svg"));
        assert!(svg.contains("t &lt;1&gt;"));
        assert!(svg.contains("<polyline"));
        assert_eq!(svg.matches("<circle").count(), 4);
        assert!(svg.trim_end().ends_with("</svg>"));
    }
}
