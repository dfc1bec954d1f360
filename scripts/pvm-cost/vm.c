#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <fcntl.h>
#include <unistd.h>
#include <time.h>
#include <sys/ioctl.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <linux/kvm.h>
extern unsigned char _binary_guest_bin_start[], _binary_guest_bin_end[];
/* Offsets of the guest's handlers from _start (run.sh passes them from nm). */

static double tcpu(void){struct timespec t;clock_gettime(CLOCK_THREAD_CPUTIME_ID,&t);return t.tv_sec*1e6+t.tv_nsec/1e3;}
static double wall(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec*1e6+t.tv_nsec/1e3;}
int main(void){
  int kvm=open("/dev/kvm",O_RDWR); int vm=ioctl(kvm,KVM_CREATE_VM,0);
  /* In-kernel LAPIC/IOAPIC (phase 14), as the VMM has; a coalesced page and an ioeventfd
   * in the MMIO hole (phases 12, 13) */
  if(ioctl(vm,KVM_CREATE_IRQCHIP,0)<0){perror("irqchip");return 1;}
  struct kvm_coalesced_mmio_zone z={.addr=0xd0001000,.size=4096};
  if(ioctl(vm,KVM_REGISTER_COALESCED_MMIO,&z)<0){perror("coalesced");return 1;}
  struct kvm_ioeventfd ev={.addr=0xd0002000,.len=4,.fd=eventfd(0,EFD_NONBLOCK)};
  if(ioctl(vm,KVM_IOEVENTFD,&ev)<0){perror("ioeventfd");return 1;}
  size_t memsz=16<<20; uint8_t*mem=mmap(0,memsz,PROT_READ|PROT_WRITE,MAP_SHARED|MAP_ANONYMOUS,-1,0);
  struct kvm_userspace_memory_region r={.slot=0,.guest_phys_addr=0,.memory_size=memsz,.userspace_addr=(uint64_t)mem};
  if(ioctl(vm,KVM_SET_USER_MEMORY_REGION,&r)<0){perror("mem");return 1;}
  memcpy(mem+0x10000,_binary_guest_bin_start,_binary_guest_bin_end-_binary_guest_bin_start);
  uint64_t*pml4=(void*)(mem+0x1000),*pdpt=(void*)(mem+0x2000),*pd=(void*)(mem+0x3000);
  pml4[0]=0x2000|7; pdpt[0]=0x3000|7; pdpt[3]=0x8000|7; for(int i=0;i<8;i++) pd[i]=((uint64_t)i<<21)|0x87;
  uint64_t*pd3=(void*)(mem+0x8000); pd3[128]=0xd0000000ULL|0x87; /* MMIO hole at 0xd0000000, unbacked */
  pd3[503]=0xfee00000ULL|0x87|0x10; /* the LAPIC page, uncached */
  uint64_t*gdt=(void*)(mem+0x500); gdt[0]=0; gdt[1]=0x00af9b000000ffffULL; gdt[2]=0x00cf93000000ffffULL; gdt[3]=0x00cf93000000ffffULL; gdt[4]=0x00cff3000000ffffULL; gdt[5]=0x00affb000000ffffULL;
  uint64_t base=0x6000; gdt[6]=0x0000890000000067ULL | ((base&0xffffff)<<16); gdt[7]=0;
  { uint64_t*idt=(void*)(mem+0x4000); for(int v=0;v<256;v++){ uint64_t h=0x10000+off_other; if(v==6) h=0x10000+off_ud;
      idt[2*v]=(h&0xffff)|(0x08ULL<<16)|((uint64_t)0x8e<<40)|(((h>>16)&0xffff)<<48); idt[2*v+1]=h>>32; }
    *(uint64_t*)(mem+0x6000+4)=0x90000; }
  int vcpu=ioctl(vm,KVM_CREATE_VCPU,0);
  int n=256; struct kvm_cpuid2*c=calloc(1,sizeof(*c)+n*sizeof(struct kvm_cpuid_entry2)); c->nent=n;
  ioctl(kvm,KVM_GET_SUPPORTED_CPUID,c); ioctl(vcpu,KVM_SET_CPUID2,c);
  struct kvm_sregs s; ioctl(vcpu,KVM_GET_SREGS,&s);
  struct kvm_segment cs={.base=0,.limit=0xffffffff,.selector=8,.type=11,.present=1,.dpl=0,.db=0,.s=1,.l=1,.g=1};
  struct kvm_segment ds={.base=0,.limit=0xffffffff,.selector=16,.type=3,.present=1,.dpl=0,.db=1,.s=1,.l=0,.g=1};
  s.cs=cs; s.ds=s.es=s.fs=s.gs=s.ss=ds; s.gdt.base=0x500; s.gdt.limit=63; s.idt.base=0; s.idt.limit=0;
  s.cr3=0x1000; s.cr4=0x20|0x200|0x400; s.cr0=0x80000033; s.efer=0x500;
  ioctl(vcpu,KVM_SET_SREGS,&s);
  struct kvm_regs rg={0}; rg.rip=0x10000; rg.rsp=0x80000; rg.rflags=2; ioctl(vcpu,KVM_SET_REGS,&rg);
  int sz=ioctl(kvm,KVM_GET_VCPU_MMAP_SIZE,0); struct kvm_run*run=mmap(0,sz,PROT_READ|PROT_WRITE,MAP_SHARED,vcpu,0);
  const char*names[]={"","cpl0: 3 emulated instructions","cpl0 PIO exit","cpl0 MMIO exit","","cpl3: 3,000 native instructions","cpl3 PIO exit","cpl3 MMIO exit","cpl3->cpl0->cpl3 (ud2)","cpl3 first touch of a page","cpl3 second touch","",
    "cpl0 coalesced MMIO write (+1/100 PIO exit)","cpl0 MMIO write to an ioeventfd","cpl0 write to the in-kernel LAPIC",""};
  int coalesced_off=ioctl(kvm,KVM_CHECK_EXTENSION,KVM_CAP_COALESCED_MMIO);
  double t0=0,w0=0; int last=0;
  for(;;){
    if(ioctl(vcpu,KVM_RUN,0)<0){perror("run");break;}
    if(run->exit_reason==KVM_EXIT_IO){ uint16_t port=run->io.port; uint32_t v=*(uint32_t*)((uint8_t*)run+run->io.data_offset);
      if(port==0xf1){ /* drain the coalesced ring: what the VMM does at each exit */
        struct kvm_coalesced_mmio_ring*ring=(void*)((uint8_t*)run+coalesced_off*4096);
        ring->first=ring->last; continue; }
      double t=tcpu(), w=wall();
      if(last>0 && last<15 && names[last][0]) printf("%-34s %8.3f us cpu/iter  %8.3f us wall/iter\n", names[last], (t-t0)/2000, (w-w0)/2000);
      if(v==0xdddd || v==0x1ff){ if(v==0x1ff) printf("exception!\n"); break;}
      last=v; t0=tcpu(); w0=wall(); continue;}
    if(run->exit_reason==KVM_EXIT_MMIO) continue;
    printf("exit reason %d\n", run->exit_reason); break;}
  return 0;}
