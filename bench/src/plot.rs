//! PNG plots drawn by burstvm itself (plotters + ab_glyph): the per-sandbox
//! timeline (FastIOV Fig. 5), the stacked average breakdown (Fig. 11), the
//! CDF of startup times (Fig. 12) and time against concurrency (Fig. 13a).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::prelude::*;
use plotters::style::FontStyle;
use trace::{Stage, TraceEvent};

use crate::stats::GroupStats;

/// Debian's fonts-dejavu-core; `BURSTVM_FONT` overrides it.
pub const DEFAULT_FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";
const FONT: &str = "sans-serif";

#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    #[error("font {path}: {reason} (install Debian's fonts-dejavu-core or set BURSTVM_FONT to a TTF file)")]
    Font { path: PathBuf, reason: String },
    #[error("plot {path}: {reason}")]
    Draw { path: PathBuf, reason: String },
    #[error("plot {path}: nothing to draw ({what})")]
    Empty { path: PathBuf, what: &'static str },
}

fn font_path() -> PathBuf {
    std::env::var_os("BURSTVM_FONT")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_FONT))
}

/// Loads the TTF once per process and registers it for plotters.
fn ensure_font() -> Result<(), PlotError> {
    static LOADED: OnceLock<Result<(), (PathBuf, String)>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            let path = font_path();
            let bytes = std::fs::read(&path).map_err(|e| (path.clone(), e.to_string()))?;
            // plotters keeps a &'static reference; the font lives as long as the process.
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            plotters::style::register_font(FONT, FontStyle::Normal, bytes)
                .map_err(|_| (path.clone(), "not a valid TrueType font".to_string()))
        })
        .clone()
        .map_err(|(path, reason)| PlotError::Font { path, reason })
}

fn draw_err<E: std::fmt::Debug>(path: &Path) -> impl Fn(E) -> PlotError + '_ {
    move |e| PlotError::Draw {
        path: path.to_path_buf(),
        reason: format!("{e:?}"),
    }
}

/// What differs between the figures' frames.
struct Frame {
    size: (u32, u32),
    y_label_area: u32,
    x: std::ops::Range<f64>,
    y: std::ops::Range<f64>,
    legend: SeriesLabelPosition,
    legend_font: u32,
}

type Chart<'a, 'b> = ChartContext<
    'a,
    BitMapBackend<'b>,
    Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>,
>;

/// Draws one PNG: a titled white canvas with `frame`'s axes, `draw`'s series,
/// then the legend of every labelled series.
fn plot(
    path: &Path,
    title: &str,
    frame: Frame,
    draw: impl FnOnce(&mut Chart<'_, '_>) -> Result<(), PlotError>,
) -> Result<(), PlotError> {
    let root = BitMapBackend::new(path, frame.size).into_drawing_area();
    root.fill(&WHITE).map_err(draw_err(path))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, (FONT, 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(frame.y_label_area)
        .build_cartesian_2d(frame.x, frame.y)
        .map_err(draw_err(path))?;
    draw(&mut chart)?;
    chart
        .configure_series_labels()
        .position(frame.legend)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font((FONT, frame.legend_font))
        .draw()
        .map_err(draw_err(path))?;
    root.present().map_err(draw_err(path))
}

fn stage_color(s: Stage) -> RGBColor {
    // Distinct hues, VF-related stages in warm colours.
    match s {
        Stage::Cgroup => RGBColor(120, 120, 120),
        Stage::Netns => RGBColor(160, 160, 200),
        Stage::CniAdd => RGBColor(90, 140, 200),
        Stage::NetClaim => RGBColor(40, 190, 200),
        Stage::VmmSpawn => RGBColor(60, 90, 160),
        Stage::Restore => RGBColor(120, 200, 120),
        Stage::DmaRam => RGBColor(220, 50, 40),
        Stage::Rootfs => RGBColor(150, 110, 60),
        Stage::DmaImage => RGBColor(250, 140, 40),
        Stage::DmaWindow => RGBColor(250, 200, 90),
        Stage::VfOpen => RGBColor(170, 30, 130),
        Stage::Boot => RGBColor(60, 170, 80),
        Stage::RootfsMount => RGBColor(180, 150, 90),
        Stage::NetConfig => RGBColor(110, 160, 230),
        Stage::VfDriver => RGBColor(240, 200, 40),
        Stage::AppLaunch => RGBColor(40, 190, 190),
        Stage::VfLink => RGBColor(200, 120, 200),
        Stage::Ready => RGBColor(30, 30, 30),
        // Incidents after startup (never plotted as stages, but named).
        Stage::VfReconnect => RGBColor(255, 0, 255),
        Stage::VfLost => RGBColor(255, 0, 0),
    }
}

fn variant_color(i: usize) -> PaletteColor<Palette99> {
    Palette99::pick(i)
}

/// Fig. 5: one horizontal line per sandbox, coloured by stage, time from `origin_ns`.
pub fn timeline(
    path: &Path,
    title: &str,
    events: &[TraceEvent],
    origin_ns: u64,
) -> Result<(), PlotError> {
    ensure_font()?;
    if events.is_empty() {
        return Err(PlotError::Empty {
            path: path.to_path_buf(),
            what: "no trace events",
        });
    }
    // Rows ordered by each sandbox's first start.
    let mut first: BTreeMap<&str, u64> = BTreeMap::new();
    for e in events {
        let f = first.entry(e.sandbox.as_str()).or_insert(e.start_ns);
        *f = (*f).min(e.start_ns);
    }
    let mut order: Vec<(&str, u64)> = first.into_iter().collect();
    order.sort_by_key(|&(sb, t)| (t, sb));
    let row: BTreeMap<&str, usize> = order
        .iter()
        .enumerate()
        .map(|(i, (sb, _))| (*sb, i))
        .collect();
    let rel = |t: u64| t.saturating_sub(origin_ns) as f64 / 1e6;
    let xmax = events
        .iter()
        .map(|e| rel(e.end_ns))
        .fold(0.0, f64::max)
        .max(1e-3)
        * 1.02;
    let n = order.len() as f64;

    let frame = Frame {
        size: (1200, 800),
        y_label_area: 60,
        x: 0f64..xmax,
        y: 0f64..n,
        legend: SeriesLabelPosition::LowerRight,
        legend_font: 14,
    };
    plot(path, title, frame, |chart| {
        chart
            .configure_mesh()
            .x_desc("time since issue (ms)")
            .y_desc("sandbox")
            .label_style((FONT, 14))
            .draw()
            .map_err(draw_err(path))?;
        // vf-open last, on top of the stages it may overlap.
        let order = Stage::ALL
            .into_iter()
            .filter(|s| *s != Stage::VfOpen)
            .chain([Stage::VfOpen]);
        for st in order {
            let evs: Vec<&TraceEvent> = events.iter().filter(|e| e.stage == st).collect();
            if evs.is_empty() {
                continue;
            }
            let color = stage_color(st);
            chart
                .draw_series(evs.iter().map(|e| {
                    let y = row[e.sandbox.as_str()] as f64;
                    let x1 = rel(e.end_ns).max(rel(e.start_ns) + xmax * 1e-4);
                    // vf-open may run beside boot (async VF init): a half-height
                    // bar drawn on top keeps both visible.
                    let top = if st == Stage::VfOpen { 0.5 } else { 0.9 };
                    Rectangle::new([(rel(e.start_ns), y + 0.1), (x1, y + top)], color.filled())
                }))
                .map_err(draw_err(path))?
                .label(st.name())
                .legend(move |(x, y)| {
                    Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled())
                });
        }
        Ok(())
    })
}

/// Fig. 11: per variant, the average critical-path time of each stage
/// stacked (queueing and gaps are the rest), and the average end-to-end
/// time as a black tick.
pub fn breakdown(path: &Path, title: &str, groups: &[GroupStats]) -> Result<(), PlotError> {
    ensure_font()?;
    if groups.is_empty() {
        return Err(PlotError::Empty {
            path: path.to_path_buf(),
            what: "no variants",
        });
    }
    let stacked = |g: &GroupStats| g.stages.iter().map(|s| s.path_avg_ms).sum::<f64>();
    let ymax = groups
        .iter()
        .map(|g| stacked(g).max(g.avg_ms))
        .fold(0.0, f64::max)
        .max(1e-3)
        * 1.1;
    let names: Vec<String> = groups.iter().map(|g| g.variant.clone()).collect();
    let n = groups.len();
    let frame = Frame {
        size: ((360 + 110 * n as u32).max(800), 700),
        y_label_area: 70,
        x: -0.5f64..(n as f64 - 0.5),
        y: 0f64..ymax,
        legend: SeriesLabelPosition::UpperRight,
        legend_font: 13,
    };
    plot(path, title, frame, |chart| {
        let fmt = |x: &f64| {
            let i = x.round();
            if (x - i).abs() < 1e-6 && i >= 0.0 {
                names.get(i as usize).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        };
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(n)
            .x_label_formatter(&fmt)
            .y_desc("average time (ms)")
            .label_style((FONT, 14))
            .draw()
            .map_err(draw_err(path))?;
        for st in Stage::ALL {
            let mut bars = Vec::new();
            for (i, g) in groups.iter().enumerate() {
                let below: f64 = g
                    .stages
                    .iter()
                    .take_while(|s| s.stage != st)
                    .map(|s| s.path_avg_ms)
                    .sum();
                if let Some(s) = g.stages.iter().find(|s| s.stage == st) {
                    let x = i as f64;
                    bars.push(Rectangle::new(
                        [(x - 0.35, below), (x + 0.35, below + s.path_avg_ms)],
                        stage_color(st).filled(),
                    ));
                }
            }
            if bars.is_empty() {
                continue;
            }
            let color = stage_color(st);
            chart
                .draw_series(bars)
                .map_err(draw_err(path))?
                .label(st.name())
                .legend(move |(x, y)| {
                    Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled())
                });
        }
        chart
            .draw_series(groups.iter().enumerate().map(|(i, g)| {
                let x = i as f64;
                PathElement::new(
                    vec![(x - 0.45, g.avg_ms), (x + 0.45, g.avg_ms)],
                    BLACK.stroke_width(3),
                )
            }))
            .map_err(draw_err(path))?
            .label("end-to-end avg")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 12, y)], BLACK.stroke_width(3)));
        Ok(())
    })
}

/// Fig. 12: empirical CDF of end-to-end startup times, one line per variant.
pub fn cdf(path: &Path, title: &str, series: &[(String, Vec<u64>)]) -> Result<(), PlotError> {
    ensure_font()?;
    if series.iter().all(|(_, v)| v.is_empty()) {
        return Err(PlotError::Empty {
            path: path.to_path_buf(),
            what: "no startup times",
        });
    }
    let xmax = series
        .iter()
        .flat_map(|(_, v)| v.iter())
        .map(|&ns| ns as f64 / 1e6)
        .fold(0.0, f64::max)
        .max(1e-3)
        * 1.05;
    let frame = Frame {
        size: (1000, 700),
        y_label_area: 60,
        x: 0f64..xmax,
        y: 0f64..1.0,
        legend: SeriesLabelPosition::LowerRight,
        legend_font: 14,
    };
    plot(path, title, frame, |chart| {
        chart
            .configure_mesh()
            .x_desc("startup time (ms)")
            .y_desc("CDF")
            .label_style((FONT, 14))
            .draw()
            .map_err(draw_err(path))?;
        for (i, (name, v)) in series.iter().enumerate() {
            if v.is_empty() {
                continue;
            }
            let mut s = v.clone();
            s.sort_unstable();
            let n = s.len() as f64;
            // A step function: each sample raises the CDF by 1/n.
            let mut pts = vec![(s[0] as f64 / 1e6, 0.0)];
            for (k, &ns) in s.iter().enumerate() {
                let x = ns as f64 / 1e6;
                pts.push((x, k as f64 / n));
                pts.push((x, (k + 1) as f64 / n));
            }
            let color = variant_color(i).to_rgba();
            chart
                .draw_series(LineSeries::new(pts, color.stroke_width(2)))
                .map_err(draw_err(path))?
                .label(name.as_str())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2))
                });
        }
        Ok(())
    })
}

/// Fig. 13a: average (solid, circles) and p99 (thin, triangles) startup time
/// against concurrency, one colour per variant.
pub fn sweep(path: &Path, title: &str, groups: &[GroupStats]) -> Result<(), PlotError> {
    ensure_font()?;
    let mut by: BTreeMap<&str, Vec<&GroupStats>> = BTreeMap::new();
    let mut order: Vec<&str> = Vec::new();
    for g in groups.iter().filter(|g| g.ready > 0) {
        if !order.contains(&g.variant.as_str()) {
            order.push(&g.variant);
        }
        by.entry(&g.variant).or_default().push(g);
    }
    if by.is_empty() {
        return Err(PlotError::Empty {
            path: path.to_path_buf(),
            what: "no concurrency level with a ready sandbox",
        });
    }
    let xmax = groups.iter().map(|g| g.concurrency).max().unwrap_or(1) as f64 * 1.05;
    let ymax = groups
        .iter()
        .map(|g| g.p99_ms.max(g.avg_ms))
        .fold(0.0, f64::max)
        .max(1e-3)
        * 1.1;
    let frame = Frame {
        size: (1000, 700),
        y_label_area: 70,
        x: 0f64..xmax,
        y: 0f64..ymax,
        legend: SeriesLabelPosition::UpperLeft,
        legend_font: 14,
    };
    plot(path, title, frame, |chart| {
        chart
            .configure_mesh()
            .x_desc("concurrency")
            .y_desc("startup time (ms)")
            .label_style((FONT, 14))
            .draw()
            .map_err(draw_err(path))?;
        for (i, name) in order.iter().enumerate() {
            let mut gs = by[name].clone();
            gs.sort_by_key(|g| g.concurrency);
            let color = variant_color(i).to_rgba();
            let avg: Vec<(f64, f64)> = gs
                .iter()
                .map(|g| (g.concurrency as f64, g.avg_ms))
                .collect();
            let p99: Vec<(f64, f64)> = gs
                .iter()
                .map(|g| (g.concurrency as f64, g.p99_ms))
                .collect();
            chart
                .draw_series(LineSeries::new(avg.clone(), color.stroke_width(2)))
                .map_err(draw_err(path))?
                .label(format!("{name} avg"))
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2))
                });
            chart
                .draw_series(avg.iter().map(|&p| Circle::new(p, 4, color.filled())))
                .map_err(draw_err(path))?;
            chart
                .draw_series(LineSeries::new(p99.clone(), color.stroke_width(1)))
                .map_err(draw_err(path))?
                .label(format!("{name} p99"))
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(1))
                });
            chart
                .draw_series(
                    p99.iter()
                        .map(|&p| TriangleMarker::new(p, 5, color.filled())),
                )
                .map_err(draw_err(path))?;
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::{group_stats, per_sandbox};

    fn synthetic(prefix: &str, n: u64, vf_ms: u64) -> Vec<TraceEvent> {
        let ms = 1_000_000u64;
        let mut out = Vec::new();
        for i in 0..n {
            let sb = format!("{prefix}-{i}");
            let mut t = 1_000 * ms + i * ms;
            for (st, d) in [
                (Stage::Cgroup, 1),
                (Stage::Netns, 1),
                (Stage::CniAdd, 3),
                (Stage::VmmSpawn, 2),
                (Stage::DmaRam, 5),
                (Stage::VfOpen, vf_ms * (i + 1)),
                (Stage::Boot, 10),
                (Stage::AppLaunch, 4),
                (Stage::Ready, 2),
            ] {
                out.push(TraceEvent {
                    sandbox: sb.clone(),
                    stage: st,
                    start_ns: t,
                    end_ns: t + d * ms,
                });
                t += d * ms;
            }
        }
        out
    }

    /// Decodes the PNG at `p` and checks that it is `size` pixels and that
    /// its plot area (inside margins, caption and axis labels) holds drawn,
    /// non-background pixels in more than one colour (series, not just axes).
    fn assert_plot(p: &Path, size: (u32, u32)) {
        let dec = png::Decoder::new(std::fs::File::open(p).unwrap());
        let mut reader = dec.read_info().unwrap();
        let mut buf = vec![0; reader.output_buffer_size()];
        let info = reader.next_frame(&mut buf).unwrap();
        assert_eq!((info.width, info.height), size, "{}", p.display());
        let bpp = info.color_type.samples() * (info.bit_depth as usize / 8);
        assert!(bpp >= 3, "{}: {:?}", p.display(), info.color_type);
        let (w, h) = (info.width as usize, info.height as usize);
        let (mut drawn, mut total) = (0usize, 0usize);
        let mut colors = std::collections::HashSet::new();
        for y in h * 15 / 100..h * 85 / 100 {
            for x in w * 20 / 100..w * 95 / 100 {
                let px = &buf[y * info.line_size + x * bpp..][..3];
                total += 1;
                if px != [255, 255, 255] {
                    drawn += 1;
                    colors.insert([px[0], px[1], px[2]]);
                }
            }
        }
        assert!(
            drawn * 200 > total,
            "{}: only {drawn} of {total} plot-area pixels drawn",
            p.display()
        );
        assert!(colors.len() >= 3, "{}: colours {colors:?}", p.display());
    }

    #[test]
    fn writes_all_four_plots() {
        let dir = tempdir();
        let van = synthetic("vanilla", 20, 8);
        let fast = synthetic("fastiov", 20, 1);
        let origin = 1_000_000_000;
        let gv = group_stats("vanilla", 20, &per_sandbox(&van, Some(origin)), 0);
        let gf = group_stats("fastiov", 20, &per_sandbox(&fast, Some(origin)), 0);
        let mut g10 = gf.clone();
        g10.concurrency = 10;
        g10.avg_ms /= 2.0;

        let p = dir.join("timeline-vanilla.png");
        timeline(&p, "vanilla", &van, origin).unwrap();
        assert_plot(&p, (1200, 800));
        let p = dir.join("breakdown.png");
        breakdown(&p, "breakdown", &[gv.clone(), gf.clone()]).unwrap();
        assert_plot(&p, (800, 700));
        let p = dir.join("cdf.png");
        let e2e = |evs: &[TraceEvent]| {
            per_sandbox(evs, Some(origin))
                .iter()
                .map(|s| s.e2e_ns)
                .collect::<Vec<_>>()
        };
        cdf(
            &p,
            "cdf",
            &[
                ("vanilla".into(), e2e(&van)),
                ("fastiov".into(), e2e(&fast)),
            ],
        )
        .unwrap();
        assert_plot(&p, (1000, 700));
        let p = dir.join("sweep.png");
        sweep(&p, "sweep", &[g10, gf, gv]).unwrap();
        assert_plot(&p, (1000, 700));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn empty_input_is_an_error() {
        let dir = tempdir();
        let e = timeline(&dir.join("t.png"), "t", &[], 0).unwrap_err();
        assert!(e.to_string().contains("nothing to draw"), "{e}");
        assert!(!dir.join("t.png").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn tempdir() -> PathBuf {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static N: AtomicUsize = AtomicUsize::new(0);
        let d = std::env::temp_dir().join(format!(
            "burstvm-plot-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}
