//! `burstvm rootfs build`: builds (or finds cached) the EROFS image of a
//! container image and prints what the cache holds; the image cache is `rootfs::image`.

use std::path::PathBuf;
use std::time::Instant;

use rootfs::image::Built;
use rootfs::ImageCache;

/// `burstvm rootfs build`.
#[derive(Debug, Clone, clap::Args)]
pub struct BuildArgs {
    /// The container image: an OCI image layout directory, an OCI archive
    /// (tar), or a plain directory.
    pub source: PathBuf,
    /// Image cache directory (default: $BURSTVM_IMAGE_CACHE or /var/lib/burstvm/images).
    #[arg(long)]
    pub cache: Option<PathBuf>,
    /// Install burstvm's Linux init as /sbin/init (for `run --kernel`).
    #[arg(long)]
    pub init: bool,
}

pub fn run(a: &BuildArgs) -> Result<(), rootfs::Error> {
    let cache = a
        .cache
        .clone()
        .map(ImageCache::new)
        .unwrap_or_else(ImageCache::from_env);
    let t0 = Instant::now();
    let (img, built) = cache.build_with(&a.source, a.init)?;
    println!("image   {}", img.path.display());
    println!("digest  {}", img.meta.digest);
    println!("kind    {}", img.meta.kind);
    println!(
        "size    {} bytes, {} files",
        img.meta.erofs_bytes,
        img.meta.files.len()
    );
    match built {
        Built::Now => println!("built in {:.1} ms", img.meta.build_ms),
        Built::Cached => println!(
            "cached (found in {:.1} ms; built in {:.1} ms)",
            t0.elapsed().as_secs_f64() * 1e3,
            img.meta.build_ms
        ),
    }
    if let Some(f) = img.default_check_file() {
        let s = img.file(&f).expect("listed");
        println!(
            "check   {f} ({} bytes, checksum {:#010x})",
            s.size, s.checksum
        );
    }
    Ok(())
}
